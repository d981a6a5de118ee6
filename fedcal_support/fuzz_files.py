"""Hostile fleet files: build a corpus of mutated files, load each, count the outcomes.

Every case is loaded by :func:`fedcal.data.loader.load_fleet` in a worker
process with a time limit (a hang kills the worker and is counted) and an
address-space limit (a runaway allocation becomes a MemoryError, counted as a
traceback rather than swapping the machine). Outcomes:

* clear error   — a FleetDataError, one line, naming the file;
* traceback     — any other exception (or an error message that is not one
                  line naming the file);
* hang          — no answer within the time limit;
* accepted      — the file loaded. Whether that is right depends on the case:
  ``refuse`` cases must not load (loaded = *silently accepted*, a defect); ``warn``
  cases must load with a warning (repeated rows: data in zero-inflated readings);
  ``valid`` cases must load with the original content (a harmless change:
  rows reordered, CRLF, an extra column …); ``intact`` cases (bit flips,
  byte junk) may load only if the data read equals the original exactly;
  ``undetectable`` cases are changes no reader can see without a checksum
  the file does not carry (a bit flip in a CSV digit, °F read as °C) and are
  reported on their own row.

    python -m fedcal_support.fuzz_files [--out DIR] [--seed 0] [--timeout 20]   # from the repo root

The test suite runs the same corpus (tests/data/test_hostile_files.py).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import select
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

COLUMNS = ["sensor_id", "frequency_hz", "temperature_c", "pressure_hpa", "split"]
NUMERIC = ["frequency_hz", "temperature_c", "pressure_hpa"]


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    expect: str  # "refuse", "valid", "intact", "undetectable" or "warn" (loads with a warning)
    kwargs: tuple = ()  # extra load_fleet arguments as (key, value) pairs


def base_frame(seed: int = 0, sensors: int = 4, points: int = 30) -> pd.DataFrame:
    """A small barometric fleet, plausible in every column (quartz-like sensors)."""
    rng = np.random.default_rng(seed)
    rows = []
    for s in range(sensors):
        f0, k = rng.normal(33_000, 300), rng.normal(2.3, 0.1)
        for i in range(points):
            p, t = rng.uniform(50, 1550), rng.uniform(-40, 60)
            split = "test" if i % 6 == 5 else "train"
            rows.append(
                (f"S{s:02d}", round(f0 + k * p + 0.4 * t, 4), round(t, 3), round(p, 3), split)
            )
    return pd.DataFrame(rows, columns=COLUMNS)


# --------------------------------------------------------------------------- corpus


def build_corpus(root: Path, seed: int = 0) -> list[Case]:
    from fedcal.data.fleet import Fleet
    from fedcal.data.loader import save_fleet

    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    frame = base_frame(seed)
    fleet = Fleet(frame)
    good_csv, good_pq = root / "good.csv", root / "good.parquet"
    save_fleet(fleet, good_csv)
    save_fleet(fleet, good_pq)
    csv_text = good_csv.read_text()
    csv_lines = csv_text.splitlines()
    pq_bytes = good_pq.read_bytes()
    cases: list[Case] = [
        Case("unchanged csv", str(good_csv), "valid"),
        Case("unchanged parquet", str(good_pq), "valid"),
    ]

    def put(name: str, content: bytes | str, expect: str, suffix: str = ".csv", **kw) -> None:
        path = root / f"{len(cases):03d}-{name.replace(' ', '_').replace('/', '_')}{suffix}"
        if isinstance(content, str):
            path.write_text(content, encoding="utf-8")
        else:
            path.write_bytes(content)
        cases.append(Case(name, str(path), expect, tuple(kw.items())))

    def csv_of(df: pd.DataFrame) -> str:
        return df.to_csv(index=False, lineterminator="\n")

    # --- Parquet written by fedcal (page checksums + metadata): bit flips and junk
    for k in range(100):
        data = bytearray(pq_bytes)
        pos = rng.randrange(len(data))
        data[pos] ^= 1 << rng.randrange(8)
        put(f"parquet bit flip {k} at byte {pos}", bytes(data), "intact", ".parquet")
    for k in range(20):
        data = bytearray(pq_bytes)
        pos = rng.randrange(len(data) - 8)
        data[pos : pos + 8] = bytes(rng.randrange(256) for _ in range(8))
        put(f"parquet 8 junk bytes {k} at {pos}", bytes(data), "intact", ".parquet")
    for cut in (
        0,
        1,
        4,
        8,
        64,
        len(pq_bytes) // 3,
        len(pq_bytes) // 2,
        len(pq_bytes) - 12,
        len(pq_bytes) - 8,
        len(pq_bytes) - 4,
        len(pq_bytes) - 1,
    ):
        put(f"parquet truncated to {cut} bytes", pq_bytes[:cut], "refuse", ".parquet")
    put("parquet doubled", pq_bytes + pq_bytes, "intact", ".parquet")

    # --- Parquet edited by another tool that kept fedcal's metadata
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(good_pq)
    relabel = frame.assign(sensor_id=frame["sensor_id"].replace({"S01": "S02"}))
    for name, df in (
        ("parquet sensor relabelled, stale metadata", relabel),
        ("parquet rows dropped, stale metadata", frame.iloc[:-6]),
        (
            "parquet one value changed, stale metadata",
            frame.assign(pressure_hpa=frame["pressure_hpa"].where(frame.index != 7, 1000.0)),
        ),
    ):
        t = pa.Table.from_pandas(df, preserve_index=False).replace_schema_metadata(
            table.schema.metadata
        )
        path = root / f"{len(cases):03d}-{name.replace(' ', '_').replace(',', '')}.parquet"
        pq.write_table(t, path)
        cases.append(Case(name, str(path), "refuse"))

    # --- Parquet from other tools (no fedcal metadata, no checksums)
    def foreign(name: str, df: pd.DataFrame, expect: str = "refuse") -> None:
        path = root / f"{len(cases):03d}-{name.replace(' ', '_')}.parquet"
        df.to_parquet(path, index=False)
        cases.append(Case(name, str(path), expect))

    foreign("foreign parquet valid", frame, "valid")
    foreign("foreign parquet pressure in Pa", frame.assign(pressure_hpa=frame.pressure_hpa * 100))
    foreign("foreign parquet frequency in kHz", frame.assign(frequency_hz=frame.frequency_hz / 1e3))
    foreign(
        "foreign parquet temperature in K", frame.assign(temperature_c=frame.temperature_c + 273.15)
    )
    foreign(
        "foreign parquet 1e308",
        frame.assign(pressure_hpa=frame.pressure_hpa.where(frame.index != 3, 1e308)),
    )
    foreign(
        "foreign parquet NaN",
        frame.assign(frequency_hz=frame.frequency_hz.where(frame.index != 3, np.nan)),
    )
    foreign(
        "foreign parquet numbers as text",
        frame.assign(pressure_hpa=frame.pressure_hpa.astype(str).where(frame.index != 4, "abc")),
    )
    foreign("foreign parquet zero rows", frame.iloc[:0])
    foreign("foreign parquet missing target", frame.drop(columns=["pressure_hpa"]))
    foreign("foreign parquet bool feature", frame.assign(temperature_c=frame.temperature_c > 0))
    plain = root / "foreign.parquet"
    frame.to_parquet(plain, index=False)
    plain_bytes = plain.read_bytes()
    for k in range(15):
        data = bytearray(plain_bytes)
        pos = rng.randrange(len(data))
        data[pos] ^= 1 << rng.randrange(8)
        put(
            f"foreign parquet (no checksums) bit flip {k} at {pos}",
            bytes(data),
            "undetectable",
            ".parquet",
        )

    # --- CSV: damage to the bytes
    raw = csv_text.encode()
    for k in range(15):
        data = bytearray(raw)
        pos = rng.randrange(len(data))
        data[pos] ^= 1 << rng.randrange(8)
        put(f"csv bit flip {k} at byte {pos}", bytes(data), "undetectable")
    for cut in (0, 1, 10, len(raw) // 2 + 3, len(raw) - 3):
        put(f"csv truncated to {cut} bytes", raw[:cut], "refuse")
    put("csv truncated at a row boundary", "\n".join(csv_lines[:-1]) + "\n", "undetectable")
    put("binary junk", bytes(rng.randrange(256) for _ in range(4096)), "refuse")
    put("utf-16 text", csv_text.encode("utf-16"), "refuse")
    put("latin-1 byte in an id", csv_text.replace("S00", "S\xe90", 1).encode("latin-1"), "refuse")
    put("NUL byte", csv_text.replace("\n", "\n\x00", 1), "refuse")
    put("only a BOM", b"\xef\xbb\xbf", "refuse")
    put("only whitespace", "   \n\n  \t\n", "refuse")
    put("header only", csv_lines[0] + "\n", "refuse")
    put("huge line", csv_text + "S00," + "9" * 10_000_000 + ",1,1,train\n", "refuse")
    put("huge field in quotes", csv_text + '"' + "x" * 300_000 + '",1,1,1,train\n', "refuse")
    put("unbalanced quote", csv_text.replace("S01", '"S01', 1), "refuse")
    put("semicolon separated", csv_text.replace(",", ";"), "refuse")
    put("ragged row", csv_text + "S00,1,2\n", "refuse")
    put("extra field in a row", csv_text + "S00,33000,20,900,train,9\n", "refuse")

    # --- CSV: wrong structure
    put(
        "duplicated header line mid-file",
        "\n".join([*csv_lines[:20], csv_lines[0], *csv_lines[20:]]) + "\n",
        "refuse",
    )
    put("duplicated column name", csv_text.replace("temperature_c", "frequency_hz", 1), "refuse")
    put("missing target column", csv_of(frame.drop(columns=["pressure_hpa"])), "refuse")
    put("renamed target column", csv_text.replace("pressure_hpa", "pressure", 1), "refuse")
    put(
        "swapped header frequency/pressure",
        csv_text.replace("frequency_hz", "@")
        .replace("pressure_hpa", "frequency_hz")
        .replace("@", "pressure_hpa"),
        "refuse",
    )
    put(
        "swapped header temperature/pressure",
        csv_text.replace("temperature_c", "@")
        .replace("pressure_hpa", "temperature_c")
        .replace("@", "pressure_hpa"),
        "refuse",
    )
    put(
        "swapped header frequency/temperature",
        csv_text.replace("frequency_hz", "@")
        .replace("temperature_c", "frequency_hz")
        .replace("@", "temperature_c"),
        "refuse",
    )
    # repeated rows are data (zero-inflated, quantized readings; issue 34.5): loaded, warned
    put("duplicated rows", csv_text + "\n".join(csv_lines[1:4]) + "\n", "warn")
    put("empty sensor id", csv_text.replace("\nS02,", "\n,", 1), "refuse")
    put("unknown split value", csv_text.replace(",test\n", ",tset\n", 1), "refuse")
    put("sensor with one point", csv_text + "S99,33000,20,900,train\n", "refuse")
    put("all rows test", csv_text.replace(",train\n", ",test\n"), "refuse")

    # --- CSV: values (each numeric column)
    for col in NUMERIC:
        for bad in (
            "nan",
            "inf",
            "-inf",
            "1e308",
            "-1e308",
            "1e16",
            "",
            "abc",
            "1,5",
            "0x1F",
            "1e999",
            "--3",
        ):
            df = frame.astype({col: object})
            df.loc[5, col] = bad
            put(f"{col} = {bad!r}", csv_of(df), "refuse")
    put("pressure in Pa", csv_of(frame.assign(pressure_hpa=frame.pressure_hpa * 100)), "refuse")
    put("pressure in kPa", csv_of(frame.assign(pressure_hpa=frame.pressure_hpa / 10)), "refuse")
    put(
        "pressure in psi",
        csv_of(frame.assign(pressure_hpa=frame.pressure_hpa * 0.0145038)),
        "refuse",
    )
    put("pressure negative", csv_of(frame.assign(pressure_hpa=frame.pressure_hpa - 2000)), "refuse")
    put("frequency in kHz", csv_of(frame.assign(frequency_hz=frame.frequency_hz / 1e3)), "refuse")
    put("frequency in MHz", csv_of(frame.assign(frequency_hz=frame.frequency_hz / 1e6)), "refuse")
    put(
        "temperature in K",
        csv_of(frame.assign(temperature_c=frame.temperature_c + 273.15)),
        "refuse",
    )
    put(
        "temperature in °F",
        csv_of(frame.assign(temperature_c=frame.temperature_c * 1.8 + 32)),
        "undetectable",
    )
    put(
        "one pressure in Pa",
        csv_of(frame.assign(pressure_hpa=frame.pressure_hpa.where(frame.index != 9, 101325.0))),
        "refuse",
    )
    put(
        "one temperature absolute zero",
        csv_of(frame.assign(temperature_c=frame.temperature_c.where(frame.index != 9, -273.15))),
        "refuse",
    )

    # --- harmless changes: must load with the same content
    put("rows shuffled", csv_of(frame.sample(frac=1.0, random_state=1)), "valid")
    put("columns reordered", csv_of(frame[list(reversed(COLUMNS))]), "valid")
    put("CRLF line ends", csv_text.replace("\n", "\r\n"), "valid")
    put("BOM", "\ufeff" + csv_text, "valid")
    put("blank lines", csv_text.replace("\n", "\n\n", 5), "valid")
    put("extra column", csv_of(frame.assign(note="ok")), "valid")
    put("quoted fields", frame.to_csv(index=False, quoting=csv.QUOTE_ALL), "valid")
    put("split in capitals", csv_text.replace(",train", ",TRAIN"), "valid")
    put(
        "exponent notation",
        csv_of(frame.assign(frequency_hz=[f"{v:.17e}" for v in frame.frequency_hz])),
        "valid",
    )

    # --- not regular files, size limit
    fifo = root / f"{len(cases):03d}-fifo.csv"
    os.mkfifo(fifo)
    cases.append(Case("named pipe .csv", str(fifo), "refuse"))
    fifo_pq = root / f"{len(cases):03d}-fifo.parquet"
    os.mkfifo(fifo_pq)
    cases.append(Case("named pipe .parquet", str(fifo_pq), "refuse"))
    for dev in ("/dev/zero", "/dev/urandom", "/dev/null"):
        for suffix in (".csv", ".parquet"):
            link = root / f"{len(cases):03d}-{Path(dev).name}{suffix}"
            link.symlink_to(dev)
            cases.append(Case(f"symlink to {dev} ({suffix})", str(link), "refuse"))
    d = root / f"{len(cases):03d}-directory.csv"
    d.mkdir()
    cases.append(Case("directory named .csv", str(d), "refuse"))
    dangling = root / f"{len(cases):03d}-dangling.csv"
    dangling.symlink_to(root / "no-such-file.csv")
    cases.append(Case("dangling symlink", str(dangling), "refuse"))
    cases.append(Case("missing file", str(root / "missing.csv"), "refuse"))
    put("no suffix", csv_text, "refuse", "")
    put("over the size limit", csv_text, "refuse", max_bytes=1000)
    return cases


# --------------------------------------------------------------------------- running


def _load(case: Case) -> tuple[str, str]:
    """``(kind, detail)``: kind is "loaded", "clear", "unclear" or "exception"."""
    from fedcal.data.loader import FleetDataError, load_fleet

    try:
        fleet = load_fleet(case.path, **dict(case.kwargs))
    except FleetDataError as e:
        text = str(e)
        one_line = "\n" not in text and case.path in text
        return ("clear" if one_line else "unclear"), text
    except Exception as e:  # the point of the exercise: anything else is a defect
        return "exception", f"{type(e).__name__}: {e}"[:300]
    columns = ["sensor_id", *NUMERIC, "split"]
    got = fleet.frame[columns].sort_values(columns).reset_index(drop=True)
    kind = "warned" if fleet.meta.get("warnings") else "loaded"  # loaded, and said why to look
    return kind, str(int(pd.util.hash_pandas_object(got, index=False).sum()))


def _worker(limit_bytes: int) -> None:
    """Answer cases read from stdin (one JSON per line) with one JSON line each."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
    for line in sys.stdin:
        fields = json.loads(line)
        case = Case(**{**fields, "kwargs": tuple(map(tuple, fields["kwargs"]))})
        try:
            answer = _load(case)
        except MemoryError:
            answer = ("exception", "MemoryError")
        print(json.dumps(answer), flush=True)


def run_corpus(
    cases: list[Case], timeout: float = 20.0, memory_bytes: int = 3 * 1024**3
) -> list[tuple[Case, str, str]]:
    """Load every case in a worker process; ``(case, outcome, detail)`` for each.

    The worker is a fresh Python (``python fuzz_files.py --worker``) restarted
    after a hang or a crash; a case unanswered within ``timeout`` is a hang.
    """
    reference = _load(Case("reference", cases[0].path, "valid"))[1]
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(memory_bytes)]
    results: list[tuple[Case, str, str]] = []
    proc: subprocess.Popen | None = None
    for case in cases:
        if proc is None:
            proc = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
        fields = {**case.__dict__, "kwargs": [list(kv) for kv in case.kwargs]}
        proc.stdin.write(json.dumps(fields) + "\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else None
        if line:
            kind, detail = json.loads(line)
        elif line is None:
            kind, detail = "hang", f"no answer in {timeout:g} s"
        else:
            kind, detail = "exception", f"worker died (exit {proc.poll()})"
        if kind == "hang" or proc.poll() is not None:
            proc.kill()
            proc.wait()
            proc = None
        results.append((case, _classify(case, kind, detail, reference), detail))
    if proc is not None:
        proc.stdin.close()
        proc.wait(10)
    return results


def _classify(case: Case, kind: str, detail: str, reference: str) -> str:
    if kind == "hang":
        return "hang"
    if kind in ("exception", "unclear"):
        return "traceback"
    if kind == "clear":
        return "wrongly refused" if case.expect in ("valid", "warn") else "clear error"
    if case.expect == "warn":  # must load and say so
        return "accepted, warned" if kind == "warned" else "silently accepted"
    if kind == "warned":  # a warning on a case that expects none: judged as loaded
        kind = "loaded"
    same = detail == reference
    if case.expect == "refuse":
        return "silently accepted"
    if case.expect == "valid":
        return "accepted, valid" if same else "silently accepted"
    if case.expect == "intact":
        return "accepted, intact" if same else "silently accepted"
    return "accepted, intact" if same else "accepted, undetectable"


def tally(results: list[tuple[Case, str, str]]) -> dict[str, Counter]:
    """Outcome counts per group: the checked files, and the undetectable ones apart."""
    groups: dict[str, Counter] = {"checked": Counter(), "undetectable": Counter()}
    for case, outcome, _ in results:
        groups["undetectable" if case.expect == "undetectable" else "checked"][outcome] += 1
    return groups


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        _worker(int(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="where to build the corpus")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=20.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        cases = build_corpus(root, args.seed)
        results = run_corpus(cases, args.timeout)
    columns = [
        "clear error",
        "traceback",
        "silently accepted",
        "hang",
        "accepted, valid",
        "accepted, warned",
        "accepted, intact",
        "accepted, undetectable",
        "wrongly refused",
    ]
    print(f"{len(results)} files, seed {args.seed}")
    print("| files | tried | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * (len(columns) + 1))
    for group, counts in tally(results).items():
        total = sum(counts.values())
        print(f"| {group} | {total} | " + " | ".join(str(counts[c]) for c in columns) + " |")
    for case, outcome, detail in results:
        if outcome in ("traceback", "silently accepted", "hang", "wrongly refused"):
            print(f"{outcome}: {case.name}: {detail}")


if __name__ == "__main__":
    main()
