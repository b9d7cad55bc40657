"""What two torchtitan runs agree on after a step that both start from one state, when only
the order of their floating-point sums differs (another number of ranks, another layout),
and the bounds the tests hold them to, on any CPU.

Read on flat checkpoints saved after every step (``test_torchtitan.flatten``:
``{"optimizer.state.<fqn>.<key>": ..., "<weight fqn>": ..., ...}``). Run ``A`` is the
reference, ``B`` the other; ``before`` and ``after`` are their checkpoints at the start and
at the end of the step; ``steps`` counts the steps since their states were equal.

Why not elementwise closeness (``sign_steps``' docstring): Dobb's update is a sign in the
bases the step holds, so a coefficient of ``C = P_rᵀ N Q_b`` within rounding of zero may
take the other sign in the other run. That moves a tile of the weights by ``2 lr alpha`` in
Frobenius norm, however small the rounding was, and the next step's gradients, momenta,
statistics and loss respond to it. Which coefficients flip depends on the CPU (AVX2 and
AVX-512 kernels round sums differently), so an elementwise tolerance tuned on one machine
fails on another. What holds on any machine, checked by ``assert_step_agrees`` and
``assert_loss_agrees``:

1. **Exact.** No sum of this step feeds them: every entry that is not a float tensor (step,
   schedule, data position, options), the float step counters, and Dobb's bases, which
   change only on a refresh step (``(step - 1) % basis_interval == 0``; asserted absent).
2. **Signs** (Dobb's weights). In each run, the step rotated into the bases,
   ``-P_rᵀ (W_after - W_before (1 - lr wd)) Q_b / (lr alpha)``, is ``±1`` in every
   coefficient, within ``SIGN_SLACK``: each run made a sign step in the bases it holds, and
   nothing else moved the weight. (Its rounding: each weight rounds to within ``u |W|`` when
   updated, which the rotation of an ``m x s`` tile gathers to at most ``sqrt(m s) u max|W|``,
   below 1e-2 of ``lr alpha`` for these tiles (``sqrt(m s) <= 56``, weights up to about 0.1);
   seen: 3e-5.) The two runs' signs differ in at most ``FLIPPED`` of a matrix's
   coefficients. The weights are compared through those signs, never entry by entry.
3. **Rounding** (gradients, momenta, statistics, Adam moments: sums over the global batch's
   ``tokens`` terms, grouped by rank). Reordering a sum of ``n`` terms in fp32 changes it
   by at most ``(n - 1) u`` times the sum of their magnitudes (Higham, *Accuracy and
   Stability of Numerical Algorithms*, 2nd ed., section 4.2; ``u = 2**-24``), so two runs
   differ by at most ``rounding(tokens) = 2 tokens u`` (6.1e-5 for 512 tokens) of the
   tensor's largest entry, for each step since their states were equal (a moving average
   carries earlier steps' rounding with weights summing to at most 1). Exact for the
   statistics (sums of ``x xᵀ``: every term is bounded by the diagonal, which holds the
   largest entry); for gradients, whose terms have mixed signs, a stated bound (the gaps
   seen: 2e-7 of the largest entry, 300 times below it).
4. **Response.** After a step that started from different weights (flipped signs in the
   step before, Adam's rounding), a state moves by its response to that difference:
   the bound of 3 plus ``RESPONSE`` times the relative difference of the weights the step
   started from (Frobenius, all parameters). ``RESPONSE`` is an allowance for how much
   this model amplifies a relative change of its weights into a relative change of a
   gradient, momentum, statistic or Adam moment (largest-entry scale): a property of the
   function, not of the CPU. Measured by planting 1 to 1,000 flips (the smallest
   coefficients of ``C``) at step 3 of the two-block debug model in one process: at most
   50; ``RESPONSE`` is 1,000.
5. **Adam's weights.** An Adam step is at most ``lr * adam_step_bound(t)`` per entry
   (``|m̂| / sqrt(v̂) <= adam_step_bound``, Cauchy-Schwarz on the two moving averages; 1.00
   at steps 3 and 4 for betas (0.9, 0.95)); where a gradient entry is itself of rounding
   size, ``m̂ / sqrt(v̂)`` turns its rounding into a step of that size (as the sign does
   for Dobb). So the step's change of the two runs' difference is within rounding in all
   but ``FLIPPED`` of the entries, and within ``2 lr adam_step_bound`` in every entry.
6. **Losses.** Step ``t``'s loss is taken at the weights the step starts from, ``W_A`` and
   ``W_B``, on the same tokens. Along the segment between them,
   ``L_B - L_A = integral of <g(W_A + s dW), dW> ds`` (``dW = W_B - W_A``, every
   parameter); for a loss quadratic along it, ``g`` is affine in ``s`` and the trapezoid
   rule is exact: ``L_B - L_A = <(g_A + g_B) / 2, dW>``. Both gradients are in the
   checkpoints: each run's step ``t`` folded its (clipped) gradient into a moving average,
   ``M_t = mu M_(t-1) + (1 - mu) g`` (Dobb's momentum; Adam's ``exp_avg`` with ``beta1``),
   and their norm is checked against the one torchtitan logs. So the losses differ from
   that prediction by at most the rounding of a mean of ``tokens`` non-negative terms and
   of the gradients (``rounding(tokens)`` of ``|L_A| + |g| |dW|``), plus the departure from
   a quadratic, allowed as large as the whole curvature term ``|<g_B - g_A, dW>|``. From
   equal weights (step 3 after the resume) that is the rounding of the loss alone.

``FLIPPED``: a sign can differ only where ``|C|`` is below the difference between the two
runs' ``C``, within bound 3 (or 4) of its largest entry. For coefficients spread like a
Gaussian (largest about 4.5 standard deviations over 10^5 of them) the fraction within
``delta`` of the largest entry of zero is about ``3.6 delta``: 2.2e-4 for one step's
rounding bound, 1e-6 for the rounding seen (3e-7 of the largest entry). ``FLIPPED`` is
1e-3 of a matrix's coefficients (196 of the largest's 196,608). Seen: none in the resharding
test on the machine these bounds were written on, one coefficient in each of two matrices
(1.5e-5 and 5e-6 of them) in ``test_torchtitan``'s pipeline test. A resumed state that is
wrong moves ``C`` by its own size: a momentum lost at the resume flipped 11 to 17% of
every matrix's coefficients (planted); one scaled by ``1 - 1e-3``, 6e-5 to 3e-4, which
bound 3 catches instead (the momentum 7e-4 of its largest entry away).
"""

import re

import torch
from sign_steps import sign_steps, stacks
from titan_checkpoints import same

from dobb.optim.dobb_core import update_alpha, update_scale_of

UNIT_ROUNDOFF = 2.0**-24  # fp32
FLIPPED = 1e-3  # fraction of a matrix's sign coefficients (or Adam entries) that may differ
SIGN_SLACK = 0.1  # a sign step is ±1 within this (rounding: below 1e-2, module docstring)
RESPONSE = 1e3  # allowance: relative change of a state per relative change of the weights
HEAD_DIM = 16  # torchtitan's debug llama3: dim 256 / 16 heads (wqkv fuses q, k, v by head)
# entries that are not model weights
NOT_WEIGHTS = ("optimizer.", "lr_scheduler.", "dataloader.", "train_state.")
COUNTERS = (".step", ".stats_steps")
BASIS = re.compile(r"\.(input|row)_basis_\d+$")


def rounding(tokens: int) -> float:
    """Bound 3: two fp32 sums of ``tokens`` terms in different orders, relative to the sum of
    the terms' magnitudes (``2 (n - 1) u``, rounded up to ``2 n u``)."""
    return 2 * tokens * UNIT_ROUNDOFF


def adam_step_bound(betas: tuple[float, float], step: int) -> float:
    """The largest ``|m̂_t| / sqrt(v̂_t)`` over any gradients: Cauchy-Schwarz on
    ``m_t = (1 - b1) sum_i b1^(t-i) g_i`` against ``v_t = (1 - b2) sum_i b2^(t-i) g_i^2``."""
    b1, b2 = betas
    ratio = sum((b1 * b1 / b2) ** j for j in range(step))
    return (1 - b1) / (1 - b1**step) * ((1 - b2**step) / (1 - b2) * ratio) ** 0.5


def parameters(flat: dict) -> dict[str, torch.Tensor]:
    """Every model weight of a flat checkpoint by the optimizer's name for it: torchtitan
    saves a fused ``wqkv`` as ``wq``, ``wk``, ``wv``; it is fused again here as its
    ``_merge_qkv_on_load`` does (by head: each key/value head after its query heads)."""
    weights = {k: v for k, v in flat.items() if not k.startswith(NOT_WEIGHTS)}
    for key in [k for k in weights if k.endswith(".wq.weight")]:
        base = key.removesuffix("wq.weight")
        wq, wk, wv = (weights.pop(f"{base}{w}.weight") for w in ("wq", "wk", "wv"))
        heads, per = wk.shape[0] // HEAD_DIM, wq.shape[0] // wk.shape[0]
        parts = [wq.reshape(heads, per, HEAD_DIM, -1)]
        parts += [w.reshape(heads, 1, HEAD_DIM, -1) for w in (wk, wv)]
        weights[f"{base}wqkv.weight"] = torch.cat(parts, dim=1).reshape(-1, wq.shape[1])
    return weights


def group(flat: dict, fqn: str, key: str):
    return flat[f"optimizer.param_groups.{fqn}.{key}"]


def bases(flat: dict, fqn: str) -> tuple[list, list]:
    """The input and row bases of ``fqn`` in a flat checkpoint, in stack order."""
    state = {
        k.removeprefix(f"optimizer.state.{fqn}."): v
        for k, v in flat.items()
        if k.startswith(f"optimizer.state.{fqn}.")
    }
    return stacks(state, "input"), stacks(state, "row")


def dobb_sign_steps(before: dict, after: dict, fqn: str) -> torch.Tensor:
    """``sign_steps.sign_steps`` of ``fqn`` between two flat checkpoints: in ``before``'s
    bases (as the step used them) and ``lr`` of this step (``before``'s param group, saved
    after the schedule moved to it)."""
    lr, decay = group(before, fqn, "lr"), group(before, fqn, "weight_decay")
    assert group(before, fqn, "coefficients") == "sign" and lr > 0, fqn
    w0, w1 = parameters(before)[fqn], parameters(after)[fqn]
    scale = update_scale_of(group(before, fqn, "update_scale"), "sign")  # None: the sign's
    alpha = update_alpha(scale, w0.shape[1])
    return sign_steps(w0, w1, *bases(before, fqn), lr=lr, weight_decay=decay, alpha=alpha)


def relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|b - a| / max|a|`` (0 where both are 0)."""
    scale = a.abs().max()
    return float((b - a).abs().max() / scale) if scale > 0 else float((b - a).abs().max())


def weight_distance(a: dict, b: dict) -> tuple[float, float]:
    """``(|W_b - W_a|, |W_a|)``: Frobenius over every model weight of two flat checkpoints."""
    wa, wb = parameters(a), parameters(b)
    assert wa.keys() == wb.keys()
    diff = sum(float((wb[k].double() - wa[k].double()).square().sum()) for k in wa)
    norm = sum(float(wa[k].double().square().sum()) for k in wa)
    return diff**0.5, norm**0.5


def assert_step_agrees(
    before: tuple[dict, dict], after: tuple[dict, dict], *, steps: int, tokens: int, skip=()
) -> dict:
    """Bounds 1 to 5 on one step of runs A and B (``before``/``after``: their flat
    checkpoints); ``steps`` since their states were equal; ``skip``: prefixes of entries not
    compared (the caller says why). Returns what was measured (the largest gaps against
    their bounds, the flipped fractions), for a report."""
    (a0, b0), (a1, b1) = before, after
    assert a1.keys() == b1.keys() == a0.keys() == b0.keys()
    distance, norm = weight_distance(a0, b0)
    state_bound = steps * rounding(tokens) + RESPONSE * distance / norm
    dobb = {
        k.removeprefix("optimizer.state.").removesuffix(".input_basis_0")
        for k in a1
        if k.endswith(".input_basis_0")
    }
    step = int(a1["train_state.step"])
    for fqn in dobb:
        interval = group(a0, fqn, "basis_interval")
        assert (step - 1) % interval, f"step {step} refreshes {fqn}'s bases: not comparable"
    measured = {"state": 0.0, "state_bound": state_bound, "flipped": {}, "sign_slack": 0.0}
    for key in a1:
        if key.startswith(tuple(skip)):
            continue
        a, b = a1[key], b1[key]
        exact = not isinstance(a, torch.Tensor) or not a.is_floating_point()
        if exact or key.endswith(COUNTERS) or BASIS.search(key):
            assert same(a, b), f"{key}: not equal (no sum of this step feeds it)"
        elif key.startswith("optimizer.state."):
            gap = relative_gap(a, b)
            measured["state"] = max(measured["state"], gap)
            assert gap <= state_bound, (
                f"{key}: differs by {gap:.3g} of its largest entry; bound {state_bound:.3g} "
                f"({steps} x rounding {rounding(tokens):.3g} + {RESPONSE:g} x relative weight "
                f"difference {distance / norm:.3g})"
            )
    wa0, wb0, wa1, wb1 = (parameters(f) for f in (a0, b0, a1, b1))
    for fqn in wa1:
        if fqn in dobb:
            sa, sb = dobb_sign_steps(a0, a1, fqn), dobb_sign_steps(b0, b1, fqn)
            for run, s in (("A", sa), ("B", sb)):
                slack = float((s.abs() - 1).abs().max())
                measured["sign_slack"] = max(measured["sign_slack"], slack)
                assert slack <= SIGN_SLACK, (
                    f"{fqn}: run {run}'s step {step} is not a sign step of lr alpha in its "
                    f"bases: a coefficient is {slack:.3g} away from ±1"
                )
            flipped = float((sa.sign() != sb.sign()).double().mean())
            measured["flipped"][fqn] = flipped
            assert flipped <= FLIPPED, (
                f"{fqn}: {flipped:.3g} of its sign coefficients differ at step {step} "
                f"(at most {FLIPPED:g})"
            )
        else:  # Adam: the step's change of the difference
            change = (wb1[fqn] - wa1[fqn]) - (wb0[fqn] - wa0[fqn])
            noise = steps * rounding(tokens) * float(wa1[fqn].abs().max())
            lr, betas = group(a0, fqn, "lr"), group(a0, fqn, "betas")
            largest = 2 * lr * adam_step_bound(betas, step) + noise
            moved = float((change.abs() > noise).double().mean())
            measured["flipped"][fqn] = moved
            assert moved <= FLIPPED, f"{fqn}: {moved:.3g} of its entries moved beyond rounding"
            assert float(change.abs().max()) <= largest, (
                f"{fqn}: an entry moved {float(change.abs().max()):.3g}, more than two Adam "
                f"steps ({largest:.3g})"
            )
    return measured


def gradients(before: dict, after: dict, grad_norm: float, max_norm: float) -> dict:
    """The gradient of every parameter at the step's start, from the moving average the
    step folded it into, ``M_after = mu M_before + (1 - mu) g`` (Dobb's ``momentum`` with
    its group's ``momentum``; Adam's ``exp_avg`` with ``beta1``), undoing torchtitan's
    clipping (``g`` scaled by ``min(1, max_norm / grad_norm)``); its norm is checked against
    ``grad_norm``, the one torchtitan logged (to 1e-3: recovered to about ``u / (1 - mu)``,
    this checks that the right state is read)."""
    grads = {}
    for fqn in parameters(after):
        state = f"optimizer.state.{fqn}."
        if state + "momentum" in after:
            key, beta = "momentum", group(after, fqn, "momentum")
        else:
            key, beta = "exp_avg", group(after, fqn, "betas")[0]
        m0, m1 = before[state + key].double(), after[state + key].double()
        grads[fqn] = (m1 - beta * m0) / (1 - beta) * max(1.0, grad_norm / max_norm)
    norm = sum(float(g.square().sum()) for g in grads.values()) ** 0.5
    assert abs(norm - grad_norm) <= 1e-3 * grad_norm, (norm, grad_norm)
    return grads


def assert_loss_agrees(
    step: int,
    records: tuple[dict, dict],
    before: tuple[dict, dict],
    after: tuple[dict, dict],
    *,
    tokens: int,
    max_norm: float,
) -> tuple[float, float, float]:
    """Bound 6 on step ``step``'s loss in runs A and B (``records``: their ``{"losses",
    "grad_norms"}`` by step; ``before``, ``after``: their flat checkpoints at the step's
    start and end; ``max_norm``: torchtitan's clipping norm). Returns ``(difference,
    predicted difference, bound on their gap)``."""
    (ra, rb), key = records, str(step)
    loss_a, loss_b = ra["losses"][key], rb["losses"][key]
    (a0, b0), (a1, b1) = before, after
    ga = gradients(a0, a1, ra["grad_norms"][key], max_norm)
    gb = gradients(b0, b1, rb["grad_norms"][key], max_norm)
    wa, wb = parameters(a0), parameters(b0)
    assert wa.keys() == wb.keys() == ga.keys() == gb.keys()
    dw = {k: wb[k].double() - wa[k].double() for k in wa}
    predicted = sum(float(((ga[k] + gb[k]) / 2 * dw[k]).sum()) for k in dw)
    curvature = abs(sum(float(((gb[k] - ga[k]) * dw[k]).sum()) for k in dw))
    norm = max(ra["grad_norms"][key], rb["grad_norms"][key])
    distance = sum(float(d.square().sum()) for d in dw.values()) ** 0.5
    bound = rounding(tokens) * (abs(loss_a) + norm * distance) + curvature
    gap = abs(loss_b - loss_a - predicted)
    assert gap <= bound, (
        f"step {step}: losses {loss_a} and {loss_b} differ by {loss_b - loss_a:.3g}, "
        f"{gap:.3g} from the {predicted:.3g} their weights' difference predicts; bound "
        f"{bound:.3g} (rounding of the loss and the gradients, curvature {curvature:.3g})"
    )
    return loss_b - loss_a, predicted, bound
