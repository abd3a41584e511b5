"""``shardwise verify``'s bf16 bounds (and fp32's parameter bound, once a layout is past it alone): the
fixed tolerances, raised to a multiple of the run's own noise floor only where the floor is above them,
and the table and notice that say which."""

from __future__ import annotations

import pytest

from shardwise.verify.parity import (
    FLOOR_CAP,
    FLOOR_FACTOR,
    FP32_FLOOR_CAP,
    TOLERANCES,
    Result,
    _params_alone,
    floor_bounds,
    floor_notice,
    format_table,
)

BF16 = TOLERANCES["bf16"]


def floor_result(loss_rel: float, param_rel: float, gap: float | None) -> Result:
    routing = None if gap is None else {"tokens": 100, "differ": 3, "max_gap": gap}
    return Result("noise floor (1 rank, micro-batches of 4 and 2)", 1, loss_rel * 5, loss_rel, param_rel,
                  True, routing=routing)


def test_a_quiet_floor_leaves_the_fixed_bounds():
    floor = floor_result(1e-5, 4e-3, 1e-3)
    assert floor_bounds(BF16, floor) == BF16
    assert floor_bounds(BF16, None) == BF16
    assert floor_notice(BF16, BF16, floor).startswith("noise floor: within the fixed bounds")


def test_a_loud_floor_raises_only_the_bounds_it_exceeds_and_says_so():
    floor = floor_result(1e-5, 0.07, 4.2e-2)  # moe-debug-like routing gap
    tol = floor_bounds(BF16, floor)
    assert tol.loss_rel == BF16.loss_rel
    assert tol.param_rel == pytest.approx(FLOOR_FACTOR * 0.07)
    assert tol.route_gap == pytest.approx(FLOOR_FACTOR * 4.2e-2)
    line = floor_notice(BF16, tol, floor)
    assert line.startswith("notice:") and "params 0.15 -> 0.21" in line and "loss" not in line.split("(")[1]
    assert "routing gap 0.02 -> 0.13" in line and "fp32" in line


def test_a_floor_too_loud_to_judge_caps_the_bounds_and_says_so():
    """A run whose reordered reference alone ends 0.57 of the update apart (deepseek-debug on a 20-step
    schedule that peaked at its last step): bounds raised to 3x that would pass a learning rate off by a
    third, so they stop at FLOOR_CAP x the fixed ones and the notice says a correct layout may fail."""
    floor = floor_result(0.46, 0.57, 1.7)
    tol = floor_bounds(BF16, floor)
    assert tol.loss_rel == pytest.approx(FLOOR_CAP * BF16.loss_rel)
    assert tol.param_rel == pytest.approx(FLOOR_CAP * BF16.param_rel) and tol.param_rel < 0.38
    line = floor_notice(BF16, tol, floor)
    assert line.startswith("notice: this run's own bf16 noise") and "widest bounds verify allows" in line
    assert "params 0.15 -> 0.3" in line and "a correct layout may fail them here" in line


def test_the_table_shows_the_floor_row_and_the_raised_bounds():
    floor = floor_result(1e-5, 0.1, None)
    tol = floor_bounds(BF16, floor_result(1e-5, 0.1, None))
    layout = Result("dp_shard=2", 2, 1e-4, 2e-5, 0.2, True)
    table = format_table([layout], tol, "bf16", floor)
    assert "params <= 0.3 of the update" in table
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and "layout" not in ln]
    assert rows[0].startswith("| noise floor") and rows[0].endswith("(the bounds' noise floor) |")
    assert rows[1].startswith("| dp_shard=2") and rows[1].endswith("| PASS |")


def test_a_weight_one_float_from_the_reference_is_its_storage_rounding_not_an_error():
    """The case --shrink met under PP x TP (a 2-wide QK-norm weight near 1 that two steps moved by
    7.7e-4): the simulated rank ended one float above the reference, 1.55e-4 of the move, over the
    fp32 bound, because fp32 stores nothing between the two. One unit in the last place is not a
    layout's error; a second one is, and so is a difference at the scale of the move."""
    import torch

    from shardwise.verify.distance import tensor_update_error

    start = torch.tensor([1.0, 1.0])
    ref = torch.tensor([1.0007040500640869, 0.9996904134750366])
    one_up = torch.nextafter(ref, torch.full_like(ref, 2.0))
    moved = (ref - start).norm().item()
    assert torch.equal((one_up - ref).abs() > 0, torch.tensor([True, True]))
    assert tensor_update_error(ref, ref, start) == 0.0
    assert tensor_update_error(one_up, ref, start) == 0.0
    two_up = torch.nextafter(one_up, torch.full_like(ref, 2.0))
    assert tensor_update_error(two_up, ref, start) > TOLERANCES["fp32"].param_rel
    off = ref + torch.tensor([moved * 1e-2, 0.0])  # (1% of the move: a layout's error, far above a float)
    assert abs(tensor_update_error(off, ref, start) - 1e-2) < 1e-3


def test_fp32_measures_its_own_noise_only_for_a_layout_past_the_parameter_bound_alone():
    """fp32's fixed bounds stand unless a layout meets the loss bound and not the parameters' one
    (the 405B preset shrunk: gradients near Adam's eps, 1.5e-4 of the update from TP's reordered sums);
    then the parameter bound rises to 3x the run's own fp32 floor, at most FP32_FLOOR_CAP x 1e-4 --
    a learning rate off by a quarter (0.25) still fails -- and the loss bound stays fixed."""
    fp32 = TOLERANCES["fp32"]
    row = lambda loss, params, err="": Result("tp=2", 2, loss, loss, params, True, err)  # noqa: E731
    assert _params_alone(row(1e-7, 1.5e-4), fp32)
    assert not _params_alone(row(1e-7, 5e-5), fp32)  # within the bounds: nothing to explain
    assert not _params_alone(row(1e-3, 1.5e-4), fp32)  # the loss fails too: a layout's error
    assert not _params_alone(row(1e-7, 1.5e-4, "the run failed"), fp32)
    floor = Result("noise floor (1 rank, TP's rounding over 2)", 1, 0.0, 0.0, 1.42e-4, True)
    tol = floor_bounds(fp32, floor, FP32_FLOOR_CAP)
    assert tol.param_rel == pytest.approx(FLOOR_FACTOR * 1.42e-4) and tol.loss_rel == fp32.loss_rel
    line = floor_notice(fp32, tol, floor, "fp32")
    assert line.startswith("notice: this run's own fp32 noise is above the fixed bounds")
    assert "the losses are still held to the fixed bound" in line
    loud = floor_bounds(fp32, Result("noise floor", 1, 0.0, 0.0, 0.5, True), FP32_FLOOR_CAP)
    assert loud.param_rel == pytest.approx(FP32_FLOOR_CAP * fp32.param_rel) and loud.param_rel < 0.25
