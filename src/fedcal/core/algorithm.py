"""The algorithm contract: pure functions over client and server trees.

An algorithm is a frozen dataclass whose fields are its hyperparameters. It
is written for a cohort of clients (every client tree has a leading clients
axis, see :mod:`fedcal.core.tree`) and must treat clients independently, so
that the simulator can run the whole fleet at once and the Flower adapter a
single client, with the same numbers. One round is::

    down    = alg.broadcast(server)                      # server → clients
    reply, private, metrics = alg.client_update(expand(down), private, data)
    server  = alg.server_update(server, reply, weights)  # replies stacked (clients, ...)

and each client's model is ``alg.personalize(expand(down), private, data)``.
Nothing here knows how clients are scheduled or where they run.

Settings are checked in one place. Each field declares its type and range once, as an
annotated type (``Annotated[float, Field(ge=0)]``, ``Literal[...]`` for a choice; the
recipe's in :class:`Recipe`); checks that need the task (the model's inputs, its layers)
or several fields together go in one hook, :meth:`Algorithm.check_task`. Both run when an
algorithm is constructed (:class:`ChecksSettings`: the fields before ``__post_init__``,
the hook after it, whatever that does) and when the configuration loads
(:func:`check_settings`, and the hook with the task the configuration describes).
``__post_init__`` derives values only.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from abc import ABCMeta, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, NamedTuple

import torch
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
from torch import Tensor

from fedcal.core.data import Batches, ClientData, full_batch, minibatches
from fedcal.core.local import GradClip, LossFn, Penalty, autograd_of, train
from fedcal.core.optim import make_optimizer, plain_sgd_lr
from fedcal.core.schema import Bool, Float, Int, checked, message
from fedcal.core.task import Task
from fedcal.core.tree import Tree, weighted_mean


class ClientResult(NamedTuple):
    """What ``client_update`` returns: the upload, the new private state, metrics (clients,)."""

    reply: Tree
    state: Tree
    metrics: dict[str, Tensor]


@checked
class Recipe:
    """The local optimizer recipe: the fields every algorithm has, and the configuration's [train].

    Names, types, defaults and ranges are declared here once; :class:`Algorithm`'s
    recipe fields are made from them (:func:`_with_recipe`), and every algorithm's recipe
    values are checked against these ranges (:func:`setting_types`), even where a method
    sets its own default (FedLSA's ``lr: float = 0.01``).
    """

    lr: Annotated[Float, Field(gt=0.0, le=10.0)] = 0.05
    local_epochs: Annotated[Int, Field(ge=0, le=10_000)] = 5
    batch_size: Annotated[Int, Field(ge=1, le=10_000_000)] = 32
    optimizer: Literal["sgd", "adam"] = "sgd"
    momentum: Annotated[Float, Field(ge=0.0, lt=1.0)] = 0.0
    weight_decay: Annotated[Float, Field(ge=0.0, le=1.0)] = 0.0
    sample_weighted: Bool = False  # aggregation weights: sample counts (True) or uniform
    # per-client L2 bound per step; 0 = off
    grad_clip: Annotated[Float, Field(ge=0.0, le=1e6)] = 0.0


RECIPE = tuple(f.name for f in dataclasses.fields(Recipe))


def _with_recipe() -> type:
    """A plain frozen dataclass of ``task`` and :class:`Recipe`'s fields: Algorithm's base.

    Plain types (the ranges stay in Recipe) and Recipe's defaults; algorithms stay
    plain dataclasses.
    """
    hints = typing.get_type_hints(Recipe)  # Annotated[float, Field(...)] -> float
    shipped = Recipe()
    recipe = [(n, hints[n], dataclasses.field(default=getattr(shipped, n))) for n in RECIPE]
    fields = dataclasses.make_dataclass("AlgorithmFields", [("task", Task), *recipe], frozen=True)
    fields.__module__ = __name__
    return fields


AlgorithmFields = _with_recipe()  # named here so that it pickles by reference


class SettingError(ValueError):
    """A method's setting outside its declared range, or unusable with the task.

    One line naming the field (``"rank: must be >= 0, got -1"``); constructing an
    algorithm adds the method's name (``"fedprior rank: ..."``), the configuration the
    file and table (``"my.toml [methods.fedprior] rank: ..."``).
    """

    def __init__(self, field: str, problem: str, method: str = "") -> None:
        super().__init__(f"{method} {field}: {problem}" if method else f"{field}: {problem}")
        self.field, self.problem = field, problem


_STRICT = ConfigDict(strict=True, arbitrary_types_allowed=True)


@functools.cache
def setting_types(cls: type) -> dict[str, TypeAdapter]:
    """Each setting of an algorithm class with its declared type and range: ``{field: adapter}``.

    From the fields' annotations (``Annotated[float, Field(gt=0)]``, ``Literal[...]``);
    recipe fields from :class:`Recipe`, whatever type a subclass re-declares them with.
    Strict: ``"3"`` is not a number and ``true`` not 1 (lists are read as tuples).
    """
    hints = typing.get_type_hints(cls, include_extras=True)
    recipe = typing.get_type_hints(Recipe, include_extras=True)
    return {
        f.name: TypeAdapter(recipe[f.name] if f.name in recipe else hints[f.name], config=_STRICT)
        for f in dataclasses.fields(cls)
        if f.name != "task"
    }


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def check_settings(cls: type, values: dict[str, Any]) -> None:
    """Each of ``values`` against its field's declared type and range, or a SettingError.

    Unknown names are left to the caller (the constructor's TypeError, the
    configuration's "unknown parameter").
    """
    types = setting_types(cls)
    for name, value in values.items():
        if name in types:
            try:
                types[name].validate_python(_tuples(value))
            except ValidationError as err:
                raise SettingError(name, message(err.errors()[0])) from None


@functools.cache
def _signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.__init__)


class ChecksSettings(ABCMeta):
    """Constructing an algorithm checks its settings: declared ranges, then the task hook.

    The given values against their declared types before ``__post_init__`` (which then
    only derives values), :meth:`Algorithm.check_task` after it. In the metaclass, not
    in ``__post_init__``, so that no subclass's ``__post_init__`` can skip either.
    """

    def __call__(cls, *args, **kwargs):
        given = _signature(cls).bind(None, *args, **kwargs).arguments
        try:
            check_settings(cls, {k: v for k, v in list(given.items())[1:] if k != "task"})
            algorithm = super().__call__(*args, **kwargs)
            algorithm.check_task(algorithm.task)
        except SettingError as err:
            raise SettingError(err.field, err.problem, cls.name) from None
        return algorithm


@dataclass(frozen=True)
class Algorithm(AlgorithmFields, metaclass=ChecksSettings):
    """Base class with FedAvg-shaped defaults and the shared local-training helpers.

    Fields common to all algorithms: the task, and the local optimizer recipe
    (:class:`Recipe`: learning rate, epochs, batch size, optimizer, momentum, weight
    decay, sample weighting, gradient clip). Subclasses add their own
    hyperparameters as fields with defaults, each typed with its range
    (``lam: Annotated[float, Field(ge=0)] = 0.1``), and put checks that need the task
    in :meth:`check_task`.
    """

    name: ClassVar[str] = "base"
    federated: ClassVar[bool] = True  # False: nothing leaves the client (a reference line)
    task_kind: ClassVar[str] = "regression"  # the task family it is written for
    # What client_update's reply may carry, by kind (fedcal.engine.flower.policy.UPLOAD_KINDS):
    # a Flower node refuses a method whose kinds its node config does not allow.
    uploads: ClassVar[tuple[str, ...]] = ("model",)

    # What server_update does with the replies (see fedcal.core.aggregation): "mean" (a
    # weighted mean, maybe followed by server steps on it), "sum" (sufficient statistics)
    # or "custom" (only screening and Krum selection may touch the replies).
    reply_aggregation: ClassVar[str] = "mean"
    # Server rules this algorithm accepts (see fedcal.core.aggregation.check_policy).
    robust_rules: ClassVar[tuple[str, ...]] = ("mean", "median", "trimmed_mean", "krum")
    # Reply path prefixes that do not judge a client in screening and Krum (fedprior's
    # candidate statistics); they are still aggregated, or rejected, with the client.
    unscreened_replies: ClassVar[tuple[str, ...]] = ()
    # screen_view(replies, rows, broadcast) -> {name: (clients, ...)}: the scale-free
    # quantities the size screen judges, leaf by leaf, instead of the judged leaves (flat
    # replies, declared rows), for leaves that grow with a unit's inputs or rows (leastsq's
    # moment whitened by its own Gram); a model leaf is judged as its update, a leaf named
    # "sum/…" as a sum over the unit's rows (raw or per row, core/stages.view_sizes).
    screen_view: ClassVar[Callable[[dict[str, Tensor], Tensor, Tree], dict[str, Tensor]] | None] = (
        None
    )
    # Optional hooks: None here, a method on the algorithms that have one.
    # beyond_support(params, x) -> (clients, rows) bool: rows the model's extrapolation
    # guard treats as outside the client's calibrated range (reported by evaluation).
    beyond_support: ClassVar[Callable[[Tree, Tensor], Tensor] | None] = None
    # inconsistent_replies(server, replies, weights, accepted) -> {client: reason} | None:
    # uploads that contradict their declared row count or the broadcast model (issue 21,
    # core/robust.py); the aggregation rejects them after screening. Needs each reply.
    inconsistent_replies: ClassVar[Callable[..., dict[int, str] | None] | None] = None
    # Optional hooks of one family (fedprior's) are not declared here: the protocols of
    # core/hooks.py (StreamsSums, BindsConsistency, TimedStd, DerivesData, EndsRounds,
    # DeclaresStatistics, WeighsOutliers, UnitColumns, StatusValues, ReadsScaler) name them,
    # and the engine tests an algorithm against the protocol (isinstance) before it calls them.
    # reads_seeds: whether client_update/personalize read ClientData.seeds (minibatches,
    # noise); a closed form that does not (fedprior) spares the engine a seed per client
    # and round (issue 25.1: 0.26 s a round at 10,000 units).
    reads_seeds: ClassVar[bool] = True
    # Closed form: round 1 computes every model and later rounds repeat it exactly (a
    # per-sensor least-squares fit). The engine runs one round for it, whatever [engine]
    # rounds says: the same numbers (tested), 1/50 of the time at the default 50 rounds.
    one_shot: ClassVar[bool] = False

    def check_task(self, task: Task) -> None:
        """Settings against the task (the model's inputs, its layers) or against each other.

        Raise :class:`SettingError` naming the field. Run after every construction (after
        ``__post_init__``) and at configuration load with the task the configuration
        describes, so a check here is never skipped. The base: nothing to check.
        """

    @property
    def uses_local_epochs(self) -> bool:
        """Whether it learns by ``local_epochs`` of SGD (then 0 is refused); closed forms: no."""
        return True

    @classmethod
    def built_class(cls, settings: dict[str, typing.Any]) -> type[Algorithm]:
        """The class ``cls(task, **settings)`` builds: ``cls``, unless a setting selects an
        algorithm of its own (FedGMI's ``interpolation = "posterior"``: fedgmi_bayes)."""
        return cls

    def configured_repr(self) -> str:
        """``repr(self)`` as the class its configuration names would print it: the run's
        identity in a checkpoint's fingerprint (``engine.simulation``).

        A class that a setting of a base class selects (:meth:`built_class`: FedGMI's
        ``interpolation = "posterior"`` builds ``FedGMIPosterior``) is named by that base,
        so a method split into its own class keeps its checkpoints resumable (the
        settings, which select it, are all in the text). Every other class: ``repr(self)``
        exactly (the dataclass repr, fields in order), so no existing checkpoint changes.
        """
        cls = type(self)
        shown = [f for f in dataclasses.fields(self) if f.repr]
        settings = {f.name: getattr(self, f.name) for f in shown if f.name != "task"}
        named = cls
        for base in cls.__mro__[1:]:
            if base is Algorithm or not issubclass(base, Algorithm):
                break
            if base.built_class(settings) is cls:
                named = base  # the outermost base whose settings build this class
        body = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in shown)
        return f"{named.__qualname__}({body})"

    # ---- the contract -------------------------------------------------
    def server_init(self, params: Tree) -> Tree:
        """Server state from freshly initialised model parameters."""
        return {"model": params}

    def broadcast(self, server: Tree) -> Tree:
        """What the server sends each participating client."""
        return server

    def client_init(self, down: Tree) -> Tree:
        """Private state of clients that have not taken part yet (``down`` expanded)."""
        return {}

    @abstractmethod
    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        """One round of local work: the reply to upload and the new private state."""

    def server_update(self, server: Tree, replies: Tree, weights: Tensor) -> Tree:
        """Aggregate replies stacked (clients, ...); ``weights`` = train rows per client.

        The weighted mean of what was uploaded (``replies["model"]``); parameters
        not uploaded (a private head, private BN layers) keep the server's values.
        """
        mean = weighted_mean(replies["model"], self.weights(weights))
        return {**server, "model": {**server["model"], **mean}}

    def personalize(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        """Each client's model parameters (a client tree)."""
        return down["model"]

    def predict(self, params: Tree, x: Tensor) -> Tensor:
        return self.task.predict(params, x)

    def predictive_std(self, params: Tree, x: Tensor) -> Tensor | None:
        """Predictive standard deviation of each prediction (clients, rows, targets), or None.

        Only methods with a probabilistic model have one (e.g. fedprior's posterior).
        """
        return None

    def interval_halfwidth(
        self, params: Tree, x: Tensor, std: Tensor | None = None
    ) -> Tensor | None:
        """Half-width of the stated central 95 % predictive interval (clients, rows, targets),
        or None. A Gaussian predictive: 1.96 × σ, σ = ``std`` (e.g. a σ at each row's time)
        or :meth:`predictive_std`."""
        std = self.predictive_std(params, x) if std is None else std
        return None if std is None else 1.959964 * std

    def client_status(self, server: Tree, personal: Tree, x: Tensor, mask: Tensor) -> dict:
        """What the method itself knows about each client's model: ``{flag: (clients,) bool}``.

        ``personal`` are the clients' final models, ``x`` (clients, rows, features) the
        inputs they are evaluated at (scaled; ``mask`` marks real rows). Flags:

        * ``"weak"``: its predictions there lean on directions of the model that the
          fleet's data do not determine (fedprior: its weakly identified directions);
        * ``"refused"``: the method declined to calibrate the client (e.g. the polynomial
          on points that cannot support a surface); what it predicts is no calibration.

        A flag not returned is False for every client. The experiment turns these flags,
        rejections and convergence into each sensor's status (docs/statuses.md).
        """
        return {}

    def export_state(self, server: Tree) -> dict | None:
        """The trained server state as JSON-able data a user can reuse, or None.

        E.g. fedprior's fleet prior, from which ``fedcal calibrate`` calibrates new units.
        """
        return None

    # ---- shared helpers -------------------------------------------------
    def weights(self, counts: Tensor) -> Tensor:
        """Aggregation weights: sample counts (FedAvg paper) or uniform (plain mean)."""
        return (
            counts.to(torch.float64)
            if self.sample_weighted
            else torch.ones_like(counts, dtype=torch.float64)
        )

    def make_optimizer(self, lr: float | None = None):
        inner = make_optimizer(
            self.optimizer, self.lr if lr is None else lr, self.momentum, self.weight_decay
        )
        return GradClip(inner, self.grad_clip) if self.grad_clip > 0 else inner

    def local_train(
        self,
        params: Tree,
        data: ClientData,
        wrt: tuple[str, ...] | None = None,
        epochs: int | None = None,
        stream: int = 0,
        penalty: Penalty | None = None,
        lr: float | None = None,
        loss: LossFn | None = None,
    ) -> tuple[Tree, Tensor]:
        """``epochs`` (default ``local_epochs``) of minibatch SGD on the cohort's rows.

        On the task's loss, or on ``loss`` (params, x, y, w) → (clients,) by autograd.
        """
        batches = minibatches(
            data, self.local_epochs if epochs is None else epochs, self.batch_size, stream
        )
        optimizer = self.make_optimizer(lr)
        if loss is None and penalty is None:
            fused = self.fused_sgd(params, batches, optimizer, wrt)
            if fused is not None:
                return fused
        grad_fn = self.task.value_and_grad if loss is None else autograd_of(loss)
        return train(grad_fn, params, batches, optimizer, wrt, penalty)

    def full_batch_steps(
        self,
        params: Tree,
        data: ClientData,
        steps: int,
        lr: float,
        wrt: tuple[str, ...] | None = None,
    ) -> Tree:
        """``steps`` plain gradient steps on the whole local set (no momentum)."""
        batches, optimizer = full_batch(data, steps), make_optimizer("sgd", lr)
        fused = self.fused_sgd(params, batches, optimizer, wrt)
        if fused is not None:
            return fused[0]
        return train(self.task.value_and_grad, params, batches, optimizer, wrt)[0]

    def fused_sgd(
        self, params: Tree, batches: Batches, optimizer: object, wrt: tuple[str, ...] | None
    ) -> tuple[Tree, Tensor] | None:
        """:func:`train` on the task's loss by the model's fused SGD loop, when the
        optimizer is plain SGD and the model has one (same numbers, fewer kernels); else None."""
        lr = plain_sgd_lr(optimizer)
        return None if lr is None else self.task.sgd_train(params, batches, lr, wrt)

    def local_loss(self, params: Tree, data: ClientData) -> Tensor:
        """Mean loss over each client's rows (clients,)."""
        return self.task.loss(params, data.x, data.y, data.mask)


def fleet_medians(values: dict[str, Tensor], least: int = 3) -> dict[str, Tensor]:
    """Each value's median over its finite entries (torch's: the lower middle one), NaN
    with fewer than ``least`` of them (:class:`fedcal.core.hooks.StatusValues`)."""
    out = {}
    for name, v in values.items():
        ok = v[torch.isfinite(v)]
        out[name] = (
            ok.median() if ok.numel() >= least else torch.tensor(float("nan"), dtype=v.dtype)
        )
    return out


@functools.cache
def options(cls: type) -> dict[str, tuple]:
    """The string options of an algorithm class: ``{field: choices}`` of its Literal fields.

    ``X | None`` of a Literal also admits None.
    """
    hints = typing.get_type_hints(cls)
    found: dict[str, tuple] = {}
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name)
        args = typing.get_args(hint) if typing.get_origin(hint) is not Literal else (hint,)
        literals = [a for a in args if typing.get_origin(a) is Literal]
        if literals:
            choices = tuple(c for lit in literals for c in typing.get_args(lit))
            found[f.name] = choices + ((None,) if type(None) in args else ())
    return found
