"""Flower deployment of any registered fedcal algorithm (SuperLink + SuperNodes).

One generic adapter runs the same algorithm files as the vectorized simulator.
A SuperNode serves a *site* — any number of sensors — and runs the client step
for all of them as one cohort; the server aggregates across sites per sensor.

* :mod:`~fedcal.engine.flower.nodes` writes one data file per site and reads it back;
* :mod:`~fedcal.engine.flower.spec` is the built algorithm as data (registered
  algorithm, field values, model): sent to every site once, in the handshake;
* :mod:`~fedcal.engine.flower.wire` is the wire format: trees and per-sensor
  parts of a site's message ↔ Flower records (dtypes bit for bit);
* :mod:`~fedcal.engine.flower.client` is what a site does with a message (its
  sensors as one cohort; private state in its state file; commit/rollback);
* :mod:`~fedcal.engine.flower.server` is the server's side (handshake, round
  messages, validation and aggregation; nodes that come and go);
* :mod:`~fedcal.engine.flower.policy` / :mod:`~fedcal.engine.flower.validation`:
  what a node agrees to send, what the server accepts;
* :mod:`~fedcal.engine.flower.loop` is the server's round loop over a transport
  (:mod:`~fedcal.engine.flower.grid`: the SuperLink's Grid; in tests, the client
  handler called in-process);
* :mod:`~fedcal.engine.flower.worker` is an optional warm process per site that
  runs its round messages for the ClientApp (torch and fedcal imported once),
  over the socket protocol of :mod:`~fedcal.engine.flower.protocol`.

The engine runs a built algorithm and never reads a configuration: the Flower
``ServerApp`` / ``ClientApp`` that do live above it, in :mod:`fedcal.apps`.
The schedule (cohorts, evaluation rounds, seeds, result rows) is
:mod:`fedcal.engine.schedule` and the evaluation step :mod:`fedcal.engine.evaluation`,
both shared with the simulator. Test support (a
local deployment, hostile clients) lives outside the package, in
``fedcal_support/`` of the repository.

Nothing here imports Flower or torch at package import time: a ClientApp is a
fresh process per message, so import time is paid every round (by the ClientApp
only for what it runs itself: with a site worker, Flower's own modules).
"""
