"""`--inputs`: the distributions q, k, v are drawn from (attn_doctor/numerics/inputs.py).

Each distribution is seeded and deterministic (in this process, in another, and in the standalone repro),
has the property it is documented to have, and `normal` draws exactly what it always drew. The case carries
the distribution (shown and written only when it is not normal), `run`, `sweep` and recipes take it, and
bisect moves it to normal. Real torch on the CPU, tiny shapes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attn_doctor.bisect.engine import Bisector, Outcome
from attn_doctor.bisect.knobs import INPUTS_PLAINEST_FIRST, coords_at, moves
from attn_doctor.cli.options import build_grid
from attn_doctor.core.case import INPUTS, Case, expand_grid, make_case
from attn_doctor.core.coords import BackendSpec, Coords
from attn_doctor.core.errors import BadInput
from attn_doctor.numerics.inputs import make_inputs
from attn_doctor.numerics.standalone import OUTLIER_SCALE, TORCH_DTYPES, outlier_channels
from cli_checks import one_line_error

CPU = torch.device("cpu")
FAULTY = Path(__file__).resolve().parent / "kernels" / "faulty.py"
TINY = ["--batch", "1", "--seq", "16", "--heads", "2", "--head-dim", "8", "--device", "cpu"]


def _case(inputs: str = "normal", **fields) -> Case:
    base = dict(batch=2, seq=64, heads=4, kv_heads=2, head_dim=64, dtype="fp32", mask="none", seed=7)
    return make_case(**{**base, **fields, "inputs": inputs})


def _tensors(case: Case) -> list[torch.Tensor]:
    x = make_inputs(case, CPU)
    return [x.q, x.k, x.v, x.dout]


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8 if t.element_size() == 1 else torch.int16 if t.element_size() == 2
                                     else torch.int32).numpy().tobytes())
    return h.hexdigest()


def _scores(case: Case, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """softmax's input, float64, [b, h, s, s_kv] (no mask: the tests' cases are mask none)."""
    group = case.heads // case.kv_heads
    return torch.einsum("bshd,bthd->bhst", q.double(), k.double().repeat_interleave(group, dim=2)) * case.softmax_scale


# --- every distribution: seeded, deterministic, in range --------------------------------------------------

@pytest.mark.parametrize("inputs", INPUTS)
def test_each_distribution_is_seeded_and_deterministic(inputs):
    case = _case(inputs, dtype="bf16")
    first, again = _tensors(case), _tensors(case)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert [t.dtype for t in first] == [torch.bfloat16] * 4
    assert [tuple(t.shape) for t in first] == [(2, 64, 4, 64), (2, 64, 2, 64), (2, 64, 2, 64), (2, 64, 4, 64)]
    other = _tensors(dataclasses.replace(case, seed=8))
    assert not any(torch.equal(a, b) for a, b in zip(first, other))


def test_distributions_differ_and_the_output_gradient_stays_normal():
    drawn = {inputs: _tensors(_case(inputs)) for inputs in INPUTS}
    assert len({_digest(t[:3]) for t in drawn.values()}) == len(INPUTS)
    for inputs, (_, _, _, dout) in drawn.items():
        assert abs(dout.std().item() - 1) < 0.05 and abs(dout.mean().item()) < 0.05, inputs
    # the scaled distributions draw normal's numbers, so even their output gradient is normal's, bit for bit
    for inputs in ("outliers", "large-logits"):
        assert torch.equal(drawn[inputs][3], drawn["normal"][3])


DETERMINISM = r'''
import hashlib, sys, torch
from attn_doctor.core.case import INPUTS, make_case
from attn_doctor.numerics.inputs import make_inputs
for inputs in INPUTS:
    x = make_inputs(make_case(batch=1, seq=24, heads=2, head_dim=16, dtype="fp32", seed=5, inputs=inputs),
                    torch.device("cpu"))
    print(inputs, hashlib.sha256(b"".join(t.numpy().tobytes() for t in (x.q, x.k, x.v, x.dout))).hexdigest())
'''


def test_every_distribution_is_the_same_in_another_process():
    proc = subprocess.run([sys.executable, "-c", DETERMINISM], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    there = dict(line.split() for line in proc.stdout.strip().splitlines())
    for inputs in INPUTS:
        x = make_inputs(make_case(batch=1, seq=24, heads=2, head_dim=16, dtype="fp32", seed=5, inputs=inputs), CPU)
        here = hashlib.sha256(b"".join(t.numpy().tobytes() for t in (x.q, x.k, x.v, x.dout))).hexdigest()
        assert there[inputs] == here, inputs


@pytest.mark.parametrize("inputs", INPUTS)
def test_every_distribution_fits_fp16(inputs):
    """Values stay far inside fp16's range (max 65504), and so do the scores a kernel forms from them."""
    case = _case(inputs, dtype="fp16", head_dim=256, seq=128)
    q, k, v, dout = _tensors(case)
    assert all(torch.isfinite(t).all() for t in (q, k, v, dout))
    assert max(t.abs().max().item() for t in (q, k, v)) < 1000
    unscaled = _scores(case, q, k) / case.softmax_scale  # q·k before the scale, as an fp16 matmul holds it
    assert unscaled.abs().max().item() < 65504 / 2


# --- each distribution's documented property ---------------------------------------------------------------

def test_normal_is_the_draw_it_always_was():
    """Hard-coded: one generator seeded with the case's seed, standard normal q, k, v, dout in this order,
    drawn in fp32 and rounded to the dtype. Every verdict before --inputs was measured on exactly these."""
    case = make_case(batch=2, seq=16, heads=4, kv_heads=2, head_dim=8, dtype="bf16", seed=1234)
    g = torch.Generator(device="cpu").manual_seed(1234)
    want = [torch.randn(shape, generator=g, dtype=torch.float32).to(torch.bfloat16)
            for shape in ((2, 16, 4, 8), (2, 16, 2, 8), (2, 16, 2, 8), (2, 16, 4, 8))]
    got = _tensors(case)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert _tensors(make_case(batch=2, seq=16, heads=4, kv_heads=2, head_dim=8, dtype="bf16", seed=1234,
                              inputs="normal"))[0].equal(want[0])


def test_uniform_is_bounded_with_unit_variance():
    for dtype in ("fp32", "bf16"):
        for t in _tensors(_case("uniform", dtype=dtype))[:3]:
            t = t.float()
            bound = 3 ** 0.5 * (1 + 2 ** -7)  # √3, plus the dtype's rounding
            assert t.abs().max().item() <= bound
            assert t.abs().max().item() > 1.7  # it reaches out to the bound: not a narrower distribution
            assert abs(t.var().item() - 1) < 0.05 and abs(t.mean().item()) < 0.05


def test_outliers_scale_a_few_fixed_channels_by_20():
    case = _case("outliers")
    q, k, v, _ = _tensors(case)
    normal = _tensors(_case("normal"))
    channels = outlier_channels(case.head_dim, case.seed)
    assert len(channels) == 64 // 32 and channels == outlier_channels(64, case.seed)  # fixed by the seed
    assert len(outlier_channels(8, 1)) == 1 and len(outlier_channels(128, 1)) == 4  # 1 in 32, at least 1
    assert len({tuple(outlier_channels(64, seed)) for seed in range(5)}) > 1  # chosen from the seed
    others = [c for c in range(case.head_dim) if c not in channels]
    for got, plain in zip((q, k, v), normal[:3]):
        rms = got.square().mean(dim=(0, 1, 2)).sqrt()
        ratio = rms[channels] / rms[others].mean()
        assert ((ratio > 15) & (ratio < 25)).all(), ratio  # about 20x the other channels, in q, k and v alike
        assert torch.equal(got[..., others], plain[..., others])  # the rest is normal's draw, untouched
        assert torch.equal(got[..., channels], plain[..., channels] * OUTLIER_SCALE)


def test_large_logits_saturate_the_softmax():
    case = _case("large-logits")
    q, k, v, _ = _tensors(case)
    normal = _tensors(_case("normal"))
    assert torch.equal(q, normal[0] * 4) and torch.equal(k, normal[1] * 4) and torch.equal(v, normal[2])
    scores = _scores(case, q, k)
    assert 14 < scores.std().item() < 18  # near 16
    top = torch.softmax(scores, dim=-1).max(dim=-1).values
    assert (top > 0.5).float().mean().item() > 0.8  # most rows are close to one-hot
    plain_top = torch.softmax(_scores(case, *normal[:2]), dim=-1).max(dim=-1).values
    assert (plain_top > 0.5).float().mean().item() < 0.05  # on normal inputs hardly any row is


def _cosines(x: torch.Tensor) -> torch.Tensor:
    """Mean cosine similarity between the tokens of each (batch, head): [b, h]."""
    unit = torch.nn.functional.normalize(x.double(), dim=-1)
    sims = torch.einsum("bshd,bthd->bhst", unit, unit)
    n = x.shape[1]
    return (sims.sum(dim=(-1, -2)) - n) / (n * (n - 1))


def test_structured_is_low_rank_with_nearly_equal_keys():
    case = _case("structured")
    q, k, v, _ = _tensors(case)
    rank = 4
    for name, t in (("q", q), ("v", v), ("k minus its token mean", k - k.mean(dim=1, keepdim=True))):
        for b in range(case.batch):
            for h in range(t.shape[2]):
                singular = torch.linalg.svdvals(t[b, :, h].double())
                assert singular[rank].item() < 1e-4 * singular[0].item(), (name, b, h)  # rank 4
                assert singular[rank - 1].item() > 1e-2 * singular[0].item(), (name, b, h)  # and not less
    assert abs(q.var().item() - 1) < 0.3 and abs(v.var().item() - 1) < 0.3  # about unit variance
    assert (_cosines(k) > 0.8).all()  # the keys of a head are nearly equal (they share its mean vector)
    assert (_cosines(q).abs() < 0.5).all()  # the queries are not
    # dQ = scale Σ_j dS_ij k_j with Σ_j dS_ij = 0: the keys' shared part cancels, so dQ is much smaller than
    # the terms it sums
    qd, kd, vd, dout = (t.double().requires_grad_() for t in _tensors(case))
    group = case.heads // case.kv_heads
    probs = torch.softmax(_scores(case, qd, kd), dim=-1)
    out = torch.einsum("bhst,bthd->bshd", probs, vd.repeat_interleave(group, dim=2))
    dq, = torch.autograd.grad(out, qd, dout)
    dprobs = torch.einsum("bshd,bthd->bhst", dout, vd.repeat_interleave(group, dim=2))
    ds = probs * (dprobs - (dprobs * probs).sum(-1, keepdim=True))
    terms = torch.einsum("bhst,bthd->bshd", ds.abs(), kd.abs().repeat_interleave(group, dim=2)) * case.softmax_scale
    assert dq.norm().item() < 0.5 * terms.norm().item()


def test_structured_rank_is_at_most_the_head_dim():
    q, k, v, _ = _tensors(_case("structured", head_dim=2))
    assert q.shape[-1] == 2 and torch.isfinite(q).all() and torch.isfinite(k).all()


def test_deep_layer_keys_and_values_share_a_direction_queries_do_not():
    """deep-layer: per head, every key shares one direction and every value another, each twice the norm of a
    token's own part (`standalone.SHARED_DIRECTION`); the queries and the output gradient are standard normal."""
    from attn_doctor.numerics.standalone import SHARED_DIRECTION

    case = _case("deep-layer")
    q, k, v, dout = _tensors(case)
    for t in (k, v):
        mean = t.double().mean(dim=1, keepdim=True)
        own = (t.double() - mean).square().sum(-1).mean(dim=1).sqrt()
        assert torch.allclose(mean[:, 0].norm(dim=-1) / own, torch.full_like(own, SHARED_DIRECTION), rtol=0.15)
        assert (_cosines(t) > 0.6).all()
    for t in (q, dout):
        assert (_cosines(t).abs() < 0.1).all() and abs(t.float().var().item() - 1) < 0.1


# --- the case ----------------------------------------------------------------------------------------------

def test_case_field_default_validation_and_identity():
    plain = make_case(batch=1, seq=16, heads=2, head_dim=8)
    assert plain.inputs == "normal" and plain == make_case(batch=1, seq=16, heads=2, head_dim=8, inputs="normal")
    skewed = dataclasses.replace(plain, inputs="outliers")
    assert skewed.key() != plain.key()  # another distribution: other inputs
    assert len(expand_grid({"batch": 1}, {"inputs": list(INPUTS)})) == len(INPUTS)
    with pytest.raises(BadInput, match="unknown inputs 'gaussian'; choose one of normal, uniform, outliers, "
                                       "large-logits, structured, deep-layer"):
        make_case(inputs="gaussian")


def test_case_strings_change_only_off_normal():
    plain = make_case(batch=1, seq=16, heads=2, head_dim=8, dtype="bf16", mask="causal", seed=3)
    assert plain.short() == "b1 s16 h2 d8 bf16 causal"
    assert plain.cli_flags() == "--batch 1 --seq 16 --heads 2 --head-dim 8 --dtype bf16 --mask causal --seed 3"
    assert "inputs" not in plain.to_dict()
    skewed = dataclasses.replace(plain, inputs="large-logits")
    assert skewed.short() == "b1 s16 h2 d8 bf16 causal large-logits"
    assert skewed.cli_flags() == ("--batch 1 --seq 16 --heads 2 --head-dim 8 --dtype bf16 --mask causal "
                                  "--inputs large-logits --seed 3")
    assert skewed.to_dict()["inputs"] == "large-logits"
    coords = Coords.call(skewed, BackendSpec("local", "local"), "transposed")
    assert "large-logits" in coords.describe() and "--inputs large-logits" in coords.repro_command("--backend local")


@pytest.mark.parametrize("inputs", INPUTS)
def test_case_round_trips_and_old_documents_load_as_normal(inputs):
    case = make_case(batch=1, seq=16, heads=2, head_dim=8, window=(4, 0), inputs=inputs)
    assert Case.from_dict(json.loads(json.dumps(case.to_dict()))) == case
    old = {"batch": 1, "seq": 16, "heads": 2, "head_dim": 8, "kv_heads": 2, "seq_kv": 16, "dtype": "bf16",
           "mask": "causal", "window": None, "seed": 1234}  # a results row written before --inputs
    assert Case.from_dict(old).inputs == "normal"
    assert Case.from_dict(old).to_dict() == old  # and written back byte for byte


def test_depth_stacks_do_not_take_another_distribution():
    case = make_case(batch=1, seq=16, heads=2, head_dim=8, inputs="outliers")
    assert "--layers" in Coords.depth(case, BackendSpec("local", "local"), 2).unsupported()
    assert Coords.depth(dataclasses.replace(case, inputs="normal"), BackendSpec("local", "local"), 2).unsupported() is None
    assert Coords.call(case, BackendSpec("local", "local")).unsupported() is None


# --- the command line ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["run", *TINY, "--inputs", "gaussian"], "'gaussian' is not one of 'normal', 'uniform', 'outliers'"),
    (["sweep", *TINY, "--inputs", "normal,gaussian"], "--inputs takes a comma list of normal, uniform, outliers"),
    (["bisect", *TINY, "--backend", "local", "--inputs", "heavy"], "'heavy' is not one of"),
    (["sweep", *TINY, "--inputs", "normal,outliers", "--layers", "2"], "--inputs does not apply to depth stacks"),
    (["bisect", *TINY, "--backend", "local", "--inputs", "outliers", "--layers", "2"],
     "--inputs does not apply to depth stacks"),
    (["run", "--recipe", "{recipe}", "--device", "cpu"], "unknown inputs 'heavy'; choose one of normal"),
])
def test_bad_inputs_exit_2_with_one_line(args, message, run_cli, tmp_path, monkeypatch):
    recipe = tmp_path / "bad.toml"
    recipe.write_text('[case]\nbatch = 1\ninputs = "heavy"\n')
    monkeypatch.chdir(tmp_path)
    line = one_line_error(run_cli([str(recipe) if a == "{recipe}" else a for a in args]))
    assert message in line, line
    assert not (tmp_path / "attn-doctor-results").exists()


@pytest.mark.slow
def test_run_on_outliers_shows_and_records_the_distribution(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_cli(["run", *TINY, "--inputs", "outliers", "--backend", "sdpa.math", "--layout", "contiguous",
                      "--layout", "transposed", "--json", "r.json"])
    assert result.exit_code == 0, result.output
    assert "b1 s16 h2 d8 bf16 causal outliers on cpu" in result.stdout
    rows = json.loads((tmp_path / "r.json").read_text())["results"]
    assert {r["backend"] for r in rows} == {"local", "sdpa.math"}
    assert all(r["case"]["inputs"] == "outliers" and r["verdict"] == "PASS" for r in rows)
    report = run_cli(["report", "r.json", "--format", "csv"])
    assert report.exit_code == 0
    header, *lines = report.stdout.strip().splitlines()
    assert "case_inputs" in header.split(",") and all(",outliers," in line for line in lines)


def test_sweep_grid_over_inputs(run_cli, tmp_path, monkeypatch):
    base, grid, _, _ = build_grid({"inputs": "normal,large-logits", "seq": "16,32"})
    assert grid["inputs"] == ["normal", "large-logits"]
    assert {(c.inputs, c.seq) for c in expand_grid(base, grid)} == {
        (i, s) for i in ("normal", "large-logits") for s in (16, 32)}
    recipe = tmp_path / "grid.toml"
    recipe.write_text('[case]\nbatch = 1\nseq = 16\nheads = 2\nhead_dim = 8\n[grid]\ninputs = ["uniform", "structured"]\n')
    base, grid, _, _ = build_grid({"recipe": str(recipe)})
    assert [c.inputs for c in expand_grid(base, grid)] == ["uniform", "structured"]

    monkeypatch.chdir(tmp_path)
    result = run_cli(["sweep", *TINY, "--inputs", "normal,structured", "--backend", "sdpa.math",
                      "--layout", "contiguous", "--out", "sweep"])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "sweep" / "results.json").read_text())["results"]
    assert sorted(r["case"].get("inputs", "normal") for r in rows) == ["normal", "normal", "structured", "structured"]
    assert all(r["verdict"] == "PASS" for r in rows)
    # the normal points keep the id they had before --inputs existed: an older sweep resumes them
    ids = {json.loads(line)["point"] for line in (tmp_path / "sweep" / "results.jsonl").read_text().splitlines()}
    assert any('"inputs"' not in point for point in ids) and any('"inputs": "structured"' in point for point in ids)


# --- bisect ------------------------------------------------------------------------------------------------

def test_bisect_knob_tries_the_plainer_distributions_plainest_first():
    assert sorted(INPUTS_PLAINEST_FIRST) == sorted(INPUTS) and INPUTS_PLAINEST_FIRST[0] == "normal"
    start = coords_at(make_case(batch=1, seq=8, heads=1, head_dim=8, dtype="fp32", mask="none", inputs="outliers"))
    tried = [value for knob, value, _ in moves(start) if knob == "inputs"]
    assert tried == ["normal", "uniform", "structured"]
    plain = dataclasses.replace(start, case=dataclasses.replace(start.case, inputs="normal"))
    assert not [knob for knob, _, _ in moves(plain) if knob == "inputs"]


def test_bisect_moves_the_distribution_to_normal_when_the_fault_does_not_need_it():
    start = coords_at(make_case(batch=2, seq=8, heads=2, head_dim=8, dtype="fp32", mask="none",
                                inputs="large-logits"))
    result = Bisector(lambda c: Outcome("FAIL", "dq: error 0.05")).run(start)
    assert result.minimal.case.inputs == "normal"
    assert "inputs" not in {c.knob for c in result.necessary}


def test_bisect_names_the_distribution_when_only_it_fails():
    start = coords_at(make_case(batch=2, seq=8, heads=2, head_dim=8, dtype="fp32", mask="none", inputs="outliers"))
    result = Bisector(lambda c: Outcome("FAIL" if c.case.inputs == "outliers" else "PASS", "dq")).run(start)
    assert result.minimal.case.inputs == "outliers"
    condition = next(c for c in result.necessary if c.knob == "inputs")
    assert condition.failing_value == "outliers" and condition.passing_value == "normal, uniform, structured"
    assert condition.sentence() == "fails at inputs outliers, passes at normal, uniform, structured"


@pytest.mark.slow
def test_bisect_cli_reduces_an_input_independent_fault_to_normal(run_cli, tmp_path, monkeypatch):
    """dq 2% too large whatever the inputs, started on uniform (where dQ does not cancel, so the fault reads
    the same on normal): bisect tries normal, it still fails, and the minimal case is on normal inputs."""
    monkeypatch.chdir(tmp_path)
    result = run_cli(["bisect", "--kernel", f"{FAULTY}:dq_two_percent", "--batch", "1", "--seq", "4", "--heads", "1",
                      "--head-dim", "8", "--dtype", "fp32", "--mask", "none", "--inputs", "uniform",
                      "--device", "cpu", "--out", "out", "--json", "b.json"])
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "b.json").read_text())
    assert doc["start_case"]["case"]["inputs"] == "uniform"
    assert "inputs" not in doc["minimal_case"]["case"]  # normal
    assert any(p["knob"] == "inputs" and p["tried"] == "normal" and p["fails"] for p in doc["probes"])


# --- the standalone repro draws the same inputs -------------------------------------------------------------

@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_repro_script_draws_exactly_make_inputs(inputs, dtype, tmp_path):
    from attn_doctor.backends import select
    from attn_doctor.bisect.repro import write_repro

    case = make_case(batch=2, seq=12, heads=4, kv_heads=2, seq_kv=20, head_dim=40, dtype=dtype, seed=11,
                     inputs=inputs)
    spec = next(s for s in select(["local"]) if s.name == "local")
    script = write_repro(tmp_path, Coords.call(case, spec), None, "test", "attn-doctor bisect")
    namespace = runpy.run_path(str(script), run_name="repro")  # main() is behind __name__ == "__main__"
    assert namespace["DEVICE"] == "cpu" and namespace["DTYPE"] == TORCH_DTYPES[dtype]
    got = namespace["inputs"]()
    want = _tensors(case)
    for name, a, b in zip(("q", "k", "v", "dout"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name


@pytest.mark.parametrize("kernel, exit_code", [("sdpa.math", 0), ("scale_blind", 1)])
def test_repro_script_uses_the_case_s_softmax_scale(kernel, exit_code, tmp_path):
    """A repro of a case with its own softmax scale: a correct path passes, a kernel that never reads the
    scale it is given fails (the scale reaches the kernel, the reference and the baseline alike)."""
    from attn_doctor.backends import select
    from attn_doctor.bisect.repro import write_repro

    blind = f"{Path(__file__).parent / 'kernels' / 'faulty.py'}:scale_blind"
    specs = select([], [blind]) if kernel == "scale_blind" else select([kernel])
    case = make_case(batch=1, seq=8, heads=2, head_dim=16, dtype="fp32", mask="causal", scale=0.1)
    script = write_repro(tmp_path, Coords.call(case, specs[-1]), None, "test", "attn-doctor bisect")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == exit_code, done.stdout + done.stderr
