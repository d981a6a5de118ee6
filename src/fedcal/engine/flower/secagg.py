"""Secure aggregation (SecAgg+) of summed statistics on the Flower path.

fedprior and fedpoly upload sums (``reply_aggregation = "sum"``): the server's
update reads only Σ_i over the round's units of each statistic and their count.
With secure aggregation on, the server learns exactly those sums and never a
site's own statistics. The protocol is SecAgg+ (Bell et al., CCS 2020), as
Flower 1.41's ``secaggplus_mod`` / ``SecAggPlusWorkflow`` run it, in four
exchanges per training round among the sites that train in it:

1. **setup**: each site makes two key pairs (ECDH, Flower's primitives): pk1
   for the pairwise masks, pk2 for encrypting key shares; the server relays
   the public keys of each site's neighbours (a ring of ``shares`` sites, the
   site in its middle; all sites when ``shares`` is 0).
2. **share keys**: each site draws a self-mask seed b, splits b and its sk1 into
   Shamir shares (``threshold`` of them reconstruct), and sends each neighbour
   its shares encrypted under their ECDH(sk2, pk2) key (Fernet).
3. **collect** (the round's train message): the site trains, encodes each of its
   sensors' statistics in fixed point (below), sums them, and uploads
   ``y = Σ_sensors enc(x) + PRG(b) + Σ_{neighbour j} ±PRG(ECDH(sk1, pk1_j))`` mod 2⁶⁴
   (+ when its node id is larger than j's, − when smaller: the pairs cancel in
   the sum). Per-sensor statistics are not in the reply.
4. **unmask**: the server tells each surviving site which neighbours' vectors
   arrived (active) and which did not (dead); a site returns its share of each
   active neighbour's b and of each dead neighbour's sk1, never both for one
   site. With ``threshold`` shares the server removes every active site's
   self-mask and the pairwise masks a dead site left in its neighbours' vectors.
   A site that dropped after step 2 is thus tolerated as long as every
   secret keeps ``threshold`` shares among the survivors.

Written here (not Flower's mod and workflow, which drive the legacy Strategy
API with one clipping range for all parameters and stochastic rounding from
NumPy's global generator): the key agreement, encryption and Shamir sharing
are Flower's (``flwr.common.secure_aggregation.crypto``,
``flwr.supercore.primitives.asymmetric``); the masks are ChaCha20 key streams
(``cryptography``) from the full 256-bit keys, added mod 2⁶⁴.

**Fixed-point encoding.** Every entry x of a statistic with range R (its
clipping bound, per statistic: :class:`SecureAggregation`; rounded up to a power
of two) is clipped to [−R, R] and rounded to the nearest multiple of the quantum
q = R·2⁻ᵇ (b = ``bits``, 84 by default): e = round(clip(x)/q), an integer of up to
85 bits carried in two 64-bit limbs (:class:`Layout`). The limbs' sums over
N ≤ 2²⁰ sensors are exact (checked), so the decoded sum differs from the sum of
the clipped entries by at most N·q/2 (:func:`quantization_bound`) before its one
float64 rounding. With b = 84, q is below the float64 spacing of every entry
above R·2⁻³¹: the encoding of such an entry is exact, and the secure sum is the
exact sum rounded once (a plain float sum rounds at every addition).
Entries beyond R are clipped (a bias, not a rounding): each site adds how many
it clipped to the secure sum, and the run reports the fleet's total.

What cannot run under it: a server stage that needs each site's (or unit's)
reply — norm screening, robust rules (median, trimmed mean, Krum), per-reply
rejection, client-level DP noise calibrated on per-unit clipping — and
statistics that are not sums (fedprior's ``interval = "calibrated"`` picks one
unit's design as the probe). :func:`refusal` names them; screening is
disabled (said in the run's output) rather than refused, since it is on by
default. fedprior's robust M-step runs with ``groups`` ≥ 2 (issue 36.2): one
secure sum per fixed group of at least two sites, each group's sums checked
and judged against the others' (:mod:`~fedcal.engine.flower.secagg_groups`);
the server then learns G sums instead of one.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedcal.engine.flower.kinds import SECAGG as SECAGG  # re-exported: the record's name

MAX_BITS = 84  # fraction bits at most: e = round(x/q), |e| ≤ 2⁸⁴, in two 64-bit limbs


LIMB = 2.0**42  # e = hi·2⁴² + lo: |hi|, lo ≤ 2⁴² per sensor


MAX_SENSORS = 1 << 20  # N·2⁴² < 2⁶³ for both limbs' sums: 1,048,576 sensors


# fedprior's GLS Gram Φᵀ C⁻¹ Φ grows as n/σ² (measured up to 7.4e7 on the default fleet,
# 384 points, fleet seeds 0 and 1; its other statistics stay below 1e4): 2³⁶ ≈ 6.9e10,
# quantum 2⁻⁴⁸. Every other statistic: ``range`` 2²⁰, quantum 2⁻⁶⁴ (84 fraction bits).
DEFAULT_RANGES: dict[str, float] = {"gls_gram": 2.0**36}


@dataclass(frozen=True)
class SecureAggregation:
    """SecAgg+ settings (Flower run config ``secure-aggregation`` and ``secagg-*``).

    ``range``: the clipping bound R of every statistic's entries (the algorithm's
    scaled units), unless ``ranges`` names the leaf (``"cand/loglik"``), its last
    component (``"gls_gram"`` for ``"cand/gls_gram"`` too) or a prefix (``"cand/"``);
    default :data:`DEFAULT_RANGES`. ``shares``: each site's neighbours including
    itself (SecAgg+'s ring; 0: every site, i.e. SecAgg); ``threshold``: the share of
    them needed to reconstruct a secret (at least 2). ``groups``: 0, one secure sum of
    every site; G ≥ 2, the training sites split into G fixed groups of at least two sites,
    one secure sum each, so that the server can check each group's sums and, with three or
    more, judge each group against the others (:mod:`~fedcal.engine.flower.secagg_groups`,
    issue 36.2).
    """

    range: float = 2.0**20
    ranges: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_RANGES))
    bits: int = MAX_BITS  # fraction bits: q = R·2^-bits
    shares: int = 0
    threshold: float = 0.5
    groups: int = 0  # ≥ 2: one secure sum per group of sites, judged (secagg_groups); 0: one sum

    def __post_init__(self) -> None:
        bad = {k: v for k, v in {"": self.range, **self.ranges}.items() if not v > 0}
        if bad or not math.isfinite(self.range):
            raise ValueError(f"secagg-range: every range must be > 0 and finite, got {bad}")
        if self.shares < 0 or self.shares == 1 or self.shares == 2:
            raise ValueError(f"secagg-shares: 0 (all sites) or >= 3, got {self.shares}")
        if not 1 <= self.bits <= MAX_BITS:
            raise ValueError(f"secagg-bits: 1 … {MAX_BITS} fraction bits, got {self.bits}")
        if not 0 < self.threshold <= 1:
            raise ValueError(f"secagg-threshold: a fraction in (0, 1], got {self.threshold}")
        if self.groups < 0 or self.groups == 1:
            raise ValueError(f"secagg-groups: 0 (one sum) or >= 2 groups, got {self.groups}")

    @classmethod
    def parse_ranges(cls, text: str) -> dict[str, float]:
        """``"gram=4096,cand/=100"`` → {"gram": 4096.0, "cand/": 100.0}."""
        out = {}
        for item in (s.strip() for s in text.split(",")):
            if not item:
                continue
            name, sep, value = item.partition("=")
            try:
                out[name.strip()] = float(value)
            except ValueError:
                sep = ""
            if not sep or not name.strip():
                raise ValueError(f"secagg-ranges: {item!r} is not name=number")
        return out

    def range_of(self, name: str) -> float:
        """The range of one leaf: its own entry, its last component's, the longest prefix
        entry's, else ``range``; rounded up to a power of two."""
        return 2.0 ** math.ceil(math.log2(self._range_of(name)))  # a power of two: exact x/q

    def _range_of(self, name: str) -> float:
        for key in (name, name.rsplit("/", 1)[-1]):
            if key in self.ranges:
                return float(self.ranges[key])
        prefixes = [p for p in self.ranges if p.endswith("/") and name.startswith(p)]
        return float(self.ranges[max(prefixes, key=len)]) if prefixes else float(self.range)

    def describe(self) -> dict[str, Any]:
        return {
            "range": self.range,
            "ranges": dict(self.ranges),
            "shares": self.shares,
            "threshold": self.threshold,
            "fraction_bits": self.bits,
            "groups": self.groups,
        }


def refusal(algorithm, policy, settings: SecureAggregation | None = None) -> str | None:
    """Why this algorithm under this ``[aggregation]`` policy cannot run under SecAgg+
    (``settings``: its groups; a robust fedprior needs ``groups`` ≥ 2)."""
    name = getattr(algorithm, "name", type(algorithm).__name__)
    if getattr(algorithm, "reply_aggregation", "mean") != "sum":
        return (
            f"secure aggregation: {name} does not upload sums (reply_aggregation "
            f"{getattr(algorithm, 'reply_aggregation', 'mean')!r}); only fedprior and fedpoly do"
        )
    if getattr(algorithm, "interval", "posterior") == "calibrated":
        return (
            f"secure aggregation: {name} with interval = 'calibrated' uploads a unit's design "
            "(the probe is one unit's, not a sum); use interval = 'posterior'"
        )
    grouped = settings is not None and settings.groups >= 2
    if getattr(algorithm, "robust", "off") != "off" and not grouped:
        return (
            f"secure aggregation: {name} with robust = {algorithm.robust!r} checks each unit's "
            "upload and weighs it by its distance to the others, which needs each reply; the "
            "server sees only the sum (set secagg-groups >= 2: each group's secure sum checked, "
            "and judged against the others'; or robust = 'off': no defence against a hostile site)"
        )
    if policy.rule != "mean":
        return (
            f"secure aggregation: rule {policy.rule!r} needs each site's reply; the server "
            "sees only the sum (use rule = 'mean')"
        )
    if policy.dp:
        return (
            "secure aggregation: client-level DP clips and noises per unit at the server, "
            "which sees only the sum (turn one of them off)"
        )
    return None


def disabled(policy) -> list[str]:
    """The policy's server stages that a secure run skips (said in its output)."""
    out = []
    if policy.screen_factor > 0:
        out.append(f"norm screening (screen_factor = {policy.screen_factor:g})")
    return [*out, "per-reply checks of shapes, dtypes and finiteness (each site checks its own)"]


@dataclass(frozen=True)
class Layout:
    """The summed vector: leaves (name, shape, range) in the reply's order, fraction bits.

    The vector is ``[count, clipped, hi limbs…, lo limbs…]`` (int64): each entry's
    integer e = round(x/q) travels as e = hi·2⁴² + lo, 0 ≤ lo < 2⁴², so up to 84
    fraction bits fit two 64-bit words and the sum of 2²⁰ sensors is exact.
    """

    leaves: tuple[tuple[str, tuple[int, ...], float], ...]
    bits: int = 84

    @classmethod
    def of(cls, shapes: Mapping[str, tuple[int, ...]], settings: SecureAggregation) -> Layout:
        bad = [k for k, s in shapes.items() if any(d < 0 for d in s)]
        if bad:
            raise ValueError(
                f"secure aggregation: reply leaves {bad} change shape with a unit's rows; "
                "only fixed-size statistics can be summed"
            )
        leaves = tuple((k, tuple(s), settings.range_of(k)) for k, s in shapes.items())
        return cls(leaves, settings.bits)

    def to_json(self) -> str:
        return json.dumps(
            {"bits": self.bits, "leaves": [[k, list(s), r] for k, s, r in self.leaves]}
        )

    @classmethod
    def from_json(cls, text: str) -> Layout:
        raw = json.loads(text)
        leaves = tuple((str(k), tuple(int(d) for d in s), float(r)) for k, s, r in raw["leaves"])
        return cls(leaves, int(raw["bits"]))

    @property
    def entries(self) -> int:
        return sum(math.prod(s) for _, s, _ in self.leaves)

    @property
    def size(self) -> int:
        return 2 + 2 * self.entries

    def quanta(self) -> np.ndarray:
        """q = R·2^-bits per statistic entry (a power of two: x/q is exact in float64)."""
        parts = [np.full(math.prod(s), r * 2.0**-self.bits) for _, s, r in self.leaves]
        return np.concatenate(parts) if parts else np.zeros(0)


def encode(layout: Layout, replies: list[Mapping[str, np.ndarray]]) -> np.ndarray:
    """Σ over sensors of enc(x) as int64 limbs, with the sensor count and clipped entries
    first (see :class:`Layout`)."""
    q = layout.quanta()
    bound = np.concatenate([np.full(math.prod(s), r) for _, s, r in layout.leaves])
    e = layout.entries
    total = np.zeros(layout.size, dtype=np.int64)
    names = [k for k, _, _ in layout.leaves]
    for reply in replies:
        if list(reply) != names:
            raise ValueError(f"secure aggregation: reply leaves {list(reply)}, layout {names}")
        flat = []
        for name, shape, _ in layout.leaves:
            a = np.asarray(reply[name], dtype=np.float64)
            if a.shape != shape:
                raise ValueError(
                    f"secure aggregation: leaf {name} has shape {a.shape}, not {shape}"
                )
            flat.append(a.reshape(-1))
        x = np.concatenate(flat) if flat else np.zeros(0)
        total[0] += 1
        total[1] += int((np.abs(x) > bound).sum())
        # |v| ≤ 2^bits ≤ 2^84, an integer in float64; hi·2⁴² and v − hi·2⁴² are exact
        v = np.rint(np.clip(x, -bound, bound) / q)
        hi = np.floor(v / LIMB)
        total[2 : 2 + e] += hi.astype(np.int64)
        total[2 + e :] += (v - hi * LIMB).astype(np.int64)
    return total


def decode(layout: Layout, total: np.ndarray) -> tuple[dict[str, np.ndarray], int, int]:
    """(sums by leaf, float64; sensor count; clipped entries) of an unmasked vector: the
    exact integer sum, rounded once to float64."""
    signed = total.view(np.int64)
    e = layout.entries
    exact = signed[2 : 2 + e].astype(object) * int(LIMB) + signed[2 + e :].astype(object)
    x = np.array([float(v) for v in exact], dtype=np.float64) * layout.quanta()
    out, at = {}, 0
    for name, shape, _ in layout.leaves:
        n = math.prod(shape)
        out[name] = x[at : at + n].reshape(shape)
        at += n
    return out, int(signed[0]), int(signed[1])


def quantization_bound(layout: Layout, sensors: int) -> dict[str, float]:
    """Largest |decoded − exact| per entry of each leaf's sum over ``sensors`` (clipped
    entries aside): N·q/2, before the one float64 rounding of the result."""
    return {name: sensors * r * 2.0**-layout.bits / 2 for name, _, r in layout.leaves}


def prg(key: bytes, n: int) -> np.ndarray:
    """n uniform 64-bit words: the ChaCha20 key stream of a 32-byte key (nonce 0)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    enc = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
    return np.frombuffer(enc.update(bytes(8 * n)), dtype="<u8").astype(np.uint64)


def _pair_key(sk1: bytes, pk1: bytes) -> bytes:
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
    from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

    key = generate_shared_key(bytes_to_private_key(sk1), bytes_to_public_key(pk1))
    return base64.urlsafe_b64decode(key)


def _fernet_key(sk2: bytes, pk2: bytes) -> bytes:
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
    from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

    return generate_shared_key(bytes_to_private_key(sk2), bytes_to_public_key(pk2))


def pair_mask(me: int, other: int, key: bytes, n: int) -> np.ndarray:
    """The pairwise mask ``me`` adds (its id larger) or subtracts: they cancel in the sum."""
    mask = prg(key, n)
    return mask if me > other else (np.uint64(0) - mask)


def neighbours(nodes: list[int], shares: int) -> dict[int, list[int]]:
    """SecAgg+'s ring: each node with the ``shares // 2`` nodes on each side (itself included)."""
    nodes = sorted(nodes)
    k = len(nodes) if shares == 0 or shares >= len(nodes) else shares | 1  # odd: symmetric
    half = k // 2
    out = {}
    for i, n in enumerate(nodes):
        ring = (
            {nodes[(i + d) % len(nodes)] for d in range(-half, half + 1)}
            if k < len(nodes)
            else set(nodes)
        )
        out[n] = sorted(ring)
    return out


def group_of(nodes: list[int], groups: int) -> dict[int, int]:
    """Each site's group (secagg-groups): node id mod ``groups``, a group of fewer than two
    sites merged into the smallest other one; fixed by the node ids, so a site's group does
    not change when another drops out. ``groups`` < 2: every site in group 0."""
    if groups < 2:
        return {n: 0 for n in nodes}
    out = {n: n % groups for n in sorted(nodes)}
    while True:
        sizes: dict[int, int] = {}
        for g in out.values():
            sizes[g] = sizes.get(g, 0) + 1
        small = [g for g, k in sorted(sizes.items()) if k < 2]
        if not small or len(sizes) == 1:
            return out
        into = min((g for g in sizes if g != small[0]), key=lambda g: (sizes[g], g))
        out = {n: into if g == small[0] else g for n, g in out.items()}


def threshold_of(settings: SecureAggregation, group: int) -> int:
    """Shares needed to reconstruct a secret among a group of ``group`` neighbours."""
    return max(2, min(group, math.ceil(settings.threshold * group)))


@dataclass
class SecureSum:
    """What the server learns in one secure round: the sums and who is in them."""

    sums: dict[str, np.ndarray]
    count: int  # sensors in the sum
    clipped: int  # entries clipped to their range, fleet total
    included: dict[int, list[int]]  # node id → its sensors in the sum
    dropped: list[int]  # sites that shared keys but whose vector never arrived (unmasked away)
    bound: dict[str, float]  # quantization_bound of each leaf
    bytes_up: int  # masked vectors received
    # secagg-groups ≥ 3: group → (its sites whose vectors are in its sum, its sums by leaf,
    # its sensor count); the server learns each group's sum. Empty: one sum.
    groups: dict[int, tuple[list[int], dict[str, np.ndarray], int]] = field(default_factory=dict)


class SecureAggregationError(RuntimeError):
    """A round whose sum cannot be recovered (too few sites or shares)."""
