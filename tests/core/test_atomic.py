"""core.atomic: the one write helper. A crash mid-write leaves the old file; nothing bypasses it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fedcal.core.atomic import write_bytes, write_text, write_with

SRC = Path(__file__).resolve().parents[2] / "src" / "fedcal"


def test_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "out.csv"
    write_text(path, "old\n")
    write_text(path, "new\n")
    assert path.read_text() == "new\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.csv"]


def test_a_writer_that_fails_halfway_leaves_the_old_file(tmp_path):
    path = tmp_path / "out.bin"
    path.write_bytes(b"precious")

    def half(tmp: Path) -> None:
        tmp.write_bytes(b"torn")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_with(path, half)
    assert path.read_bytes() == b"precious"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_kill_9_in_the_middle_of_a_write_leaves_the_old_file(tmp_path):
    """A real crash: the process SIGKILLs itself after writing half of the new content."""
    path = tmp_path / "out.txt"
    path.write_text("old content\n")
    script = (
        "import os, signal\n"
        "from fedcal.core.atomic import write_with\n"
        "def half(tmp):\n"
        "    with open(tmp, 'x') as fh:\n"
        "        fh.write('new con'); fh.flush(); os.fsync(fh.fileno())\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        f"write_with({str(path)!r}, half)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC.parent)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert path.read_text() == "old content\n"
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "out.txt"]
    assert all(n.startswith(".out.txt.") and n.endswith(".tmp") for n in leftovers)


def test_a_private_file_is_never_readable_by_others(tmp_path):
    path = tmp_path / "node.key"
    write_bytes(path, b"secret", mode=0o600)
    assert path.stat().st_mode & 0o077 == 0
    assert path.read_bytes() == b"secret"


# Writes that bypass core.atomic: to a final path directly, or a hand-made rename.
BYPASS = [
    r"\.write_text\(",
    r"\.write_bytes\(",
    r"\bos\.replace\(",
    r"\bos\.rename\(",
    r"\.replace\(\s*(out|path|tmp)",
    r"open\([^)]*,\s*['\"][wa]",
    r"\.to_csv\(\s*(?!index=|fh\b|\))",  # .to_csv() returns the text: no file
    r"\.to_parquet\(",
    r"\.savefig\(\s*(?!buf\b)",
]


# Not outputs (a child process's log, appended while it runs, is in the test support,
# fedcal_support/flower_local.py). The certificate's pages go to a PdfPages over an
# in-memory buffer, which core.atomic.write_bytes then writes (certificate_pdf.py).
ALLOWED: set[tuple[str, str]] = {("report/certificate_pdf.py", "self.pdf.savefig(self.fig)")}


def test_every_writer_in_src_goes_through_core_atomic():
    """A static check: outside core/atomic.py, files are created only inside write_with's
    callback (exclusive ``open(tmp, "x")``), never written or renamed in place."""
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "atomic.py" and path.parent.name == "core":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            where = (str(path.relative_to(SRC)), code.strip())
            if any(re.search(p, code) for p in BYPASS) and where not in ALLOWED:
                offenders.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    assert offenders == []


def test_the_bypass_check_can_fail(tmp_path):
    bad = ['out.write_text("x")', "frame.to_csv(out, index=False)", "os.replace(tmp, out)"]
    for line in bad:
        assert any(re.search(p, line) for p in BYPASS), line
    good = [
        "write_text(out, frame.to_csv(index=False))",
        "frame.to_csv(fh, index=False)",
        "digest.update(frame.to_csv().encode())",
    ]
    for line in good:
        assert not any(re.search(p, line) for p in BYPASS), line
