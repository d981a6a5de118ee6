"""The Flower adapter's message vocabulary, in one place: the kinds of exchange the round
loop asks of the sites, the steps of secure aggregation, and the records that name what a
message or a reply is.

Every sender and receiver (``loop``, ``grid``, ``secagg``, ``client``, ``server``, the
ServerApp and ClientApp, the hostile test clients) takes these names from here; the values
are the strings on the wire, unchanged. This module imports nothing of fedcal, so every
module of the adapter may import it without a cycle.
"""

from __future__ import annotations

from enum import StrEnum


class Kind(StrEnum):
    """One exchange of messages between the server and the sites (``Transport.exchange``).

    Flower carries a handshake and a step of secure aggregation as a query, a round as a
    train message and the last, evaluation-only message as an evaluate message
    (``grid.GridTransport.exchange``).
    """

    HANDSHAKE = "handshake"  # the run's algorithm; each sensor's identity and row count
    TRAIN = "train"  # a round: evaluate the previous one and/or train this one
    EVALUATE = "evaluate"  # the last message: evaluation only
    SECAGG = "secagg"  # a step of secure aggregation (keys, shares, unmasking)


class Stage(StrEnum):
    """The steps of secure aggregation (SecAgg+, ``secagg``), in the order they run."""

    SETUP = "setup"  # key pairs
    SHARE = "share"  # encrypted shares of the secrets
    COLLECT = "collect"  # the masked sums (the round's train message)
    UNMASK = "unmask"  # the shares that remove the masks


CONTROL = "fedcal"  # the ConfigRecord that steers a message (round, sensors to train …)
SECAGG = str(Kind.SECAGG)  # the record of a secure-aggregation message and its reply
REFUSED = "refused"  # a site's reply that declines the message: {reason, site-id[, round]}
SITE = "site"  # a round reply's record of the site that sent it: {site-id, round}
