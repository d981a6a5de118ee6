"""What a SuperNode agrees to share: its node config's allowed methods and upload kinds.

A SuperNode runs whatever method the server's message names, so the node,
not the server, must decide what leaves it. Every algorithm declares the
kinds of what its ``client_update`` reply may carry
(:attr:`fedcal.core.algorithm.Algorithm.uploads`); the node config may set

``allow-uploads``
    comma-separated kinds of :data:`UPLOAD_KINDS`, or ``"*"`` for all.
    Default: every kind except ``raw_rows``.
``allow-methods``
    comma-separated registered algorithm names, or ``"*"`` (default). A
    variant (``[methods.x] base = "fedavg"``) is judged by the algorithm it
    builds, so a server cannot rename ``centralized`` into an allowed name.

A request outside the policy is answered with a ``refused`` record naming
the reason (the node trains nothing, shares nothing, keeps no state); the
server reports it and stops asking that node. The federated-scaling sums of
the handshake (n, Σx, Σx²) are ``statistics`` and obey the same policy.
Besides the reply tree, a node always sends its train/test metrics and its
declared train-row count; a client's round seed (a function of run seed,
round and client index, known to the server) is not counted as an upload.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# kind → what it is (the vocabulary of Algorithm.uploads)
UPLOAD_KINDS: dict[str, str] = {
    "model": "model parameters (all or part) after local training",
    "raw_rows": "the client's raw (scaled) training rows",
    "statistics": "sufficient statistics of the local data (Gram matrices, sums)",
    "public_outputs": "the model's features or predictions on public inputs",
    "prototypes": "per-class mean embeddings of the local data",
    "label_counts": "histogram of the local targets (classes or pressure bins)",
    "gradients": "loss and gradient at the received model, curvature estimates",
    "costs": "per-sample time/energy costs and samples processed",
    "update_directions": "leading singular directions of the local update",
    "cluster_choice": "which of the global models fits the local data best",
    "validation_losses": "held-out loss of each candidate model",
}
DEFAULT_REFUSED = frozenset({"raw_rows"})


class PolicyError(ValueError):
    """A node config whose allow-methods / allow-uploads cannot be read."""


def _names(node_cfg: Mapping, key: str) -> frozenset[str] | None:
    """The comma-separated set under ``key``; None for "*" (everything)."""
    value = node_cfg.get(key, "*")
    if not isinstance(value, str):
        raise PolicyError(f"node config {key}={value!r}: expected a comma-separated string")
    names = frozenset(n.strip() for n in value.split(",") if n.strip())
    return None if "*" in names else names


@dataclass(frozen=True)
class NodePolicy:
    """The methods and upload kinds a node allows (None: any)."""

    methods: frozenset[str] | None
    uploads: frozenset[str] | None
    uploads_set: bool = True  # False: allow-uploads absent from the node config (the default)

    @classmethod
    def from_node_config(cls, node_cfg: Mapping) -> NodePolicy:
        methods = _names(node_cfg, "allow-methods")
        if "allow-uploads" in node_cfg:
            uploads = _names(node_cfg, "allow-uploads")
        else:
            uploads = frozenset(UPLOAD_KINDS) - DEFAULT_REFUSED
        unknown = sorted((uploads or frozenset()) - set(UPLOAD_KINDS))
        if unknown:
            raise PolicyError(
                f"node config allow-uploads names unknown kinds {unknown}; "
                f"known: {', '.join(UPLOAD_KINDS)} (or '*')"
            )
        return cls(methods, uploads, "allow-uploads" in node_cfg)

    def describe(self, key: str) -> str:
        """``allow-uploads=model,statistics`` as the node config would say it."""
        allowed = self.methods if key == "allow-methods" else self.uploads
        if key == "allow-uploads" and not self.uploads_set:
            return f"{key} unset: every kind but {','.join(sorted(DEFAULT_REFUSED))}"
        return f"{key}=" + ("*" if allowed is None else ",".join(sorted(allowed)) or "''")

    def refusal(self, requested: str, algorithm: str, uploads: tuple[str, ...]) -> str | None:
        """Why this node refuses to run ``requested`` (built as ``algorithm``); None: allowed."""
        name = repr(requested) + ("" if requested == algorithm else f" (algorithm {algorithm!r})")
        if self.methods is not None and algorithm not in self.methods:
            return (
                f"refused method {name}: not allowed by its node config "
                f"({self.describe('allow-methods')})"
            )
        if self.uploads is not None:
            denied = [k for k in uploads if k not in self.uploads]
            if denied:
                what = "; ".join(f"{k} ({UPLOAD_KINDS.get(k, 'undeclared kind')})" for k in denied)
                return (
                    f"refused method {name}: uploads {what}, not allowed by its node config "
                    f"({self.describe('allow-uploads')})"
                )
        return None

    def refuses_kind(self, kind: str) -> bool:
        return self.uploads is not None and kind not in self.uploads
