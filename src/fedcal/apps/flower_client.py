"""The Flower ClientApp: one SuperNode serves a site (any number of sensors); any algorithm.

Node config (``flower-supernode --node-config``, TOML values)::

    data-path='/abs/lab-a.npz' site-id='lab-a' state-dir='/abs/state' worker-socket='/abs/w.sock'

(``worker-socket`` optional: see :mod:`fedcal.engine.flower.worker`). See
:mod:`fedcal.engine.flower.client` for what each message does. Heavy imports
(torch, the algorithms) happen inside the handlers, after Flower has started
the process, only for round messages (the handshake needs NumPy), and not at
all when a warm site worker runs the message.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

app = ClientApp()


@app.query()
def handshake(msg: Message, context: Context) -> Message:
    """The run's algorithm (kept by the site); per sensor: identity, row count (and sums).

    Or a step of secure aggregation (:mod:`fedcal.engine.flower.secagg`): keys, shares.
    """
    from fedcal.engine.flower.secagg import SECAGG

    if SECAGG in msg.content:
        from fedcal.engine.flower.secagg_site import site_stage

        node = msg.metadata.dst_node_id
        content = site_stage(msg.content, context.node_config, context.run_id, node)
        return Message(content, reply_to=msg)
    from fedcal.engine.flower.client import answer_handshake

    return Message(answer_handshake(msg.content, context.node_config, context.run_id), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Round message: evaluate the previous round and/or train this one.

    On the site's warm worker if the node config names one (``worker-socket``),
    else in this process.
    """
    from fedcal.engine.flower.secagg import SECAGG
    from fedcal.engine.flower.worker import run_round_here_or_on_worker

    if SECAGG in msg.content:  # the statistics leave only inside the masked sum
        from fedcal.engine.flower.secagg_site import site_round

        content = site_round(
            msg.content, context.node_config, context.run_id, run_round_here_or_on_worker
        )
        return Message(content, reply_to=msg)
    content = run_round_here_or_on_worker(msg.content, context.node_config, context.run_id)
    return Message(content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """The last message of a run: evaluation only (same handler, no training asked)."""
    return train(msg, context)
