"""FedPrior's parts, built once from its settings, and the hooks each part implements.

:class:`~fedcal.algorithms.fedprior.FedPrior` is the model and its federated EM; every option
around it is a part, a frozen dataclass whose fields are the settings it reads (docs/design.md,
"The flagship algorithms, one idea per file"):

* the design [φ, b·ψ] and its predictive form (:class:`DesignBasis`, ``fedprior_basis``; the
  chamber's sweep direction, issue 10, and every Cholesky through
  :func:`~fedcal.core.bayes.safe_cholesky` for field networks, issue 26);
* the complexity from the fleet's evidence (``select = "bic"``): the candidate sub-bases
  (:class:`EvidenceSelection`, ``fedprior_select``), every candidate's EM and the BIC choice
  (:class:`CandidateEMs`, ``fedprior_candidates``, C1–C4; with ``select_by = "marginal"`` one
  EM and one clipped score per candidate, what client-level DP needs);
* the rounds' schedule: the choice frozen, the hold-out once, the stop (:class:`RoundSchedule`,
  ``fedprior_rounds``, R1–R3);
* the noise model (issues 20, 26; :class:`NoiseModel`, ``fedprior_noise``, N1–N7): σ²(x) =
  σ_i² exp(γᵀx) while BIC keeps γ, Student-t rows, or the tail by the fleet's likelihood;
* the calibrated interval (issue 20; :class:`CalibratedInterval`, ``fedprior_interval``,
  I1–I4): σ² on residual degrees of freedom, a discrepancy variance by a design-matched
  hold-out, or no interval where the fleet cannot learn one;
* the time-respecting choice and the interval after calibration (issue 34;
  :class:`TimeChoice`, ``fedprior_choice``; :class:`ForwardInterval`, ``fedprior_forward``);
* the extrapolation guard (:class:`SupportBox`, ``fedprior_support``), the direction term's
  unidentified coordinates (:class:`BranchPins`, ``fedprior_pins``), identification and the
  exported prior (:class:`PriorStatus`, ``fedprior_status``), client-level DP's bounds
  (:class:`PrivateStatistics`, ``fedprior_dp``), a hostile site or unit (issue 21;
  :class:`RobustUploads`, ``fedprior_robust``, docs/safety.md) and the streamed round
  (:class:`StreamedSums`, ``fedprior_stream``).

:func:`build_parts` builds them all by one rule (``fedprior_declared.declared``): a part's
field is the setting of its name (or prefixed name), unless given (the basis, the parts it is
built from). :class:`Delegate` makes a part's method one of FedPrior's hooks (core/hooks.py), read
through FedPrior's attribute so that a subclass's override is the one called. This module
imports the parts, never ``fedprior.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedcal.algorithms.fedprior_basis import DesignBasis, Terms, tensor_basis
from fedcal.algorithms.fedprior_candidates import CandidateEMs
from fedcal.algorithms.fedprior_choice import TimeChoice
from fedcal.algorithms.fedprior_declared import declared
from fedcal.algorithms.fedprior_dp import PrivateStatistics
from fedcal.algorithms.fedprior_forward import ForwardInterval
from fedcal.algorithms.fedprior_interval import CalibratedInterval
from fedcal.algorithms.fedprior_noise import NoiseModel
from fedcal.algorithms.fedprior_pins import BranchPins
from fedcal.algorithms.fedprior_robust import RobustUploads
from fedcal.algorithms.fedprior_rounds import RoundSchedule
from fedcal.algorithms.fedprior_select import EvidenceSelection
from fedcal.algorithms.fedprior_status import PriorStatus
from fedcal.algorithms.fedprior_stream import StreamedSums
from fedcal.algorithms.fedprior_support import SupportBox


@dataclass(frozen=True)
class FedPriorParts:
    """FedPrior's parts (module doc), each built once from the settings it declares."""

    design_basis: DesignBasis
    selection: EvidenceSelection
    noise_model: NoiseModel
    support_box: SupportBox
    branch_pins: BranchPins
    rounds_schedule: RoundSchedule
    candidate_ems: CandidateEMs
    prior_status: PriorStatus
    calibrated: CalibratedInterval
    time_choice: TimeChoice
    private_statistics: PrivateStatistics
    streamed: StreamedSums
    robust_uploads: RobustUploads


def build_parts(settings: dict[str, Any], inputs: int, terms: Terms, psi: Terms) -> FedPriorParts:
    """Every part from the algorithm's ``settings`` (its dataclass fields by name), its
    ``inputs``, and φ's and ψ's ``terms``, in the order they are built from each other."""
    s = settings
    tensor = tensor_basis(s["basis"], s["orders"], inputs)
    known: dict[str, Any] = {"inputs": inputs, "terms": terms, "branch_terms": psi}
    known.update(tensor=tensor, features=len(terms) + len(psi), phi_terms=len(terms))
    known["basis"] = DesignBasis(terms, psi)  # (not the setting "basis": the design)
    known["selection"] = declared(EvidenceSelection, s, known)
    known["noise_model"] = noise = declared(NoiseModel, s, known)
    known["support_box"] = declared(SupportBox, s, known)
    known["pins"] = declared(BranchPins, s, known)
    # the time-respecting choice scores every candidate each round (its forward folds): the
    # basis is never frozen under it (R1)
    patience = s["select_patience"] if s["choose"] == "off" else 0
    each = known["selection"].each_candidate
    schedule = declared(RoundSchedule, s, known | {"select_patience": patience, "candidates": each})
    known["schedule"] = schedule
    candidate_ems = declared(CandidateEMs, s, known)
    known["forward"] = declared(ForwardInterval, s, known, prefix="choice_")
    time_choice = declared(TimeChoice, s, known, prefix="choice_")
    dp = {"branch": bool(s["branch_orders"]), "weighted": noise.weighted}
    lin = time_choice.linear_terms
    k = len(known["selection"].candidates) if candidate_ems.on else 0
    robust = {"candidates": k, "linear_terms": None if lin is None else tuple(lin)}
    return FedPriorParts(
        design_basis=known["basis"],
        selection=known["selection"],
        noise_model=noise,
        support_box=known["support_box"],
        branch_pins=known["pins"],
        rounds_schedule=schedule,
        candidate_ems=candidate_ems,
        prior_status=declared(PriorStatus, s, known),
        calibrated=declared(CalibratedInterval, s, known),
        time_choice=time_choice,
        private_statistics=declared(PrivateStatistics, s, known | dp, prefix="dp_"),
        streamed=declared(StreamedSums, s, known),
        robust_uploads=declared(RobustUploads, s, known | robust),
    )


class Delegate:
    """A FedPrior attribute that is a part's: ``finished = Delegate("rounds_schedule")`` reads
    ``algorithm.rounds_schedule.finished``, ``Delegate("rounds_schedule", "before")`` its
    ``before``; ``Delegate("parts")`` the part of that name itself. The part is read through
    the algorithm's attribute, so a subclass that overrides the hook or the part is the one
    called, and a runtime-checkable protocol of core/hooks.py sees the hook."""

    def __init__(self, owner: str, member: str | None = None) -> None:
        self.owner, self.member = owner, member

    def __set_name__(self, cls: type, name: str) -> None:
        self.member = self.member or name

    def __get__(self, algorithm: Any, cls: type | None = None) -> Any:
        if algorithm is None:
            return self
        return getattr(getattr(algorithm, self.owner), self.member)  # type: ignore[arg-type]
