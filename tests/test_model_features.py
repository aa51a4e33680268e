"""Megatron-LM's model-feature flags (--swiglu, --normalization, --group-query-attention, rope,
--disable-bias-linear, --qk-layernorm, ...) on megatron-core's own layer specs.

References (Megatron-LM's arguments.py and gpt_builders.py at core_v0.16.1): every parameter's
name and shape against a table derived by hand from the flags, and the rope frequencies; PP=2
runs learn; a PP=2 flush run's losses equal a PP=1 run's from the same checkpoint to fp32
rounding; bad combinations end in one FlagError line (exit code 2). Guards: the flags build the
model Megatron-LM builds. The shape rules and the runs: docs/testing.md, "What each test module
checks", test_model_features.py.
"""

from __future__ import annotations

import math
import shutil

import pytest

from megatron_2bw.arguments import FlagError, parse_args
from megatron_2bw.logparse import parse_log
from tests import dist as launch

TINY = ["--cpu", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--lr", "1e-3",
        "--micro-batch-size", "4", "--global-batch-size", "16",
        "--mock-data", "--eval-iters", "0", "--log-interval", "1", "--train-iters", "1"]
LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--group-query-attention",
         "--num-query-groups", "2", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
H, HEADS, LAYERS, VOCAB = 32, 4, 2, 1024  # --mock-data's vocabulary, a multiple of 128
HEAD_DIM = H // HEADS
ITERS = 7  # the PP=1 run saves after iteration 1; iterations 2..7 are compared
TRAIN = [*TINY, *LLAMA, "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-2",
         "--lr-decay-style", "constant", "--train-iters", str(ITERS)]
LOSS_RTOL = 2e-6  # fp32 rounding; the log prints 7 significant digits


# ---- (a) the built model --------------------------------------------------------------------

FLAG_SETS = {
    "default": [],
    "llama": [*LLAMA, "--rotary-base", "500", "--rotary-percent", "0.5",
              "--rotary-seq-len-interpolation-factor", "2"],
    "variants": ["--qk-layernorm", "--squared-relu", "--disable-bias-linear", "--add-qkv-bias",
                 "--kv-channels", "16", "--position-embedding-type", "none",
                 "--norm-epsilon", "1e-6", "--apply-residual-connection-post-layernorm"],
    "openai-gelu": ["--openai-gelu", "--apply-query-key-layer-scaling"],
}


def build_worker(rank: int, world_size: int) -> dict:
    """Build each flag set's GPTModel (TP=PP=1) through our config and provider; record its
    parameters, module types, config fields, rope frequencies and one forward/backward."""
    from megatron_2bw.runtime import distributed

    distributed.initialize(1, 1, seed=1234, force_cpu=True)  # the CPU runtime first
    results = {name: _built(parse_args([*TINY, *flags], world_size=1))
               for name, flags in FLAG_SETS.items()}
    results["bert-qk-layernorm"] = _bert_spec_error(parse_args([*TINY, "--qk-layernorm"], 1))
    results["layernorm-1p"] = _zero_centered_against_torch_norms()
    distributed.destroy()
    return results


def _built(args) -> dict:
    import torch

    import pretrain_gpt_2bw
    from megatron_2bw.training import build

    config = build.transformer_config(args, "cpu")
    model = pretrain_gpt_2bw.model_provider(config, pre_process=True, post_process=True,
                                            args=args, vocab_size=VOCAB)
    tokens = torch.randint(0, VOCAB, (2, 16))  # (b, s)
    positions = torch.arange(16).expand(2, 16)
    losses = model(tokens, positions, None, labels=tokens)  # (b, s)
    losses.mean().backward()
    layer = model.decoder.layers[0]
    rope = getattr(model, "rotary_pos_emb", None)
    return {
        "params": {n: tuple(p.shape) for n, p in model.named_parameters()},
        "norms": {n: type(m).__name__ for n, m in model.named_modules()
                  if "norm" in n and type(m).__name__ != "IdentityOp"},
        "norm_eps": layer.input_layernorm.eps,
        "activation": config.activation_func.__name__,
        "gated": config.gated_linear_unit,
        "softmax_in_fp32": config.attention_softmax_in_fp32,
        "post_layernorm_residual": config.apply_residual_connection_post_layernorm,
        "inv_freq": None if rope is None else rope.inv_freq.tolist(),
        "interpolation": None if rope is None else rope.seq_len_interpolation_factor,
        "loss": float(losses.mean()),
    }


def _zero_centered_against_torch_norms() -> dict:
    """--apply-layernorm-1p on the local spec, against megatron-core's torch norms: a model
    whose norm weights are w gives the logits of the plain model whose weights are 1 + w."""
    import torch

    import pretrain_gpt_2bw
    from megatron_2bw.training import build

    results = {}
    for normalization in ("LayerNorm", "RMSNorm"):
        flags = [*TINY, "--qk-layernorm", "--normalization", normalization]
        models = {}
        for name, extra in (("plain", []), ("1p", ["--apply-layernorm-1p"])):
            args = parse_args([*flags, *extra], world_size=1)
            config = build.transformer_config(args, "cpu")
            models[name] = pretrain_gpt_2bw.model_provider(
                config, pre_process=True, post_process=True, args=args, vocab_size=VOCAB).eval()
        norm_weights = [n for n, p in models["1p"].named_parameters()
                        if "norm" in n and n.endswith("weight")]
        state = models["plain"].state_dict()
        for name in norm_weights:
            state[name] = torch.randn_like(state[name]) * 0.1 + 1  # gamma away from 1
        models["plain"].load_state_dict(state)
        starts_at_zero = all(float(models["1p"].state_dict()[n].abs().max()) == 0
                             for n in norm_weights)
        models["1p"].load_state_dict({n: t - 1 if n in norm_weights else t
                                      for n, t in state.items()})
        tokens = torch.randint(0, VOCAB, (2, 16))
        positions = torch.arange(16).expand(2, 16)
        with torch.no_grad():
            logits = {n: m(tokens, positions, None) for n, m in models.items()}
        results[normalization] = {
            "norm_weights": len(norm_weights), "starts_at_zero": starts_at_zero,
            "norm_types": sorted({type(m).__name__ for n, m in models["1p"].named_modules()
                                  if n.endswith("norm")} - {"IdentityOp"}),
            "max_abs_diff": float((logits["1p"] - logits["plain"]).abs().max()),
            "scale": float(logits["plain"].abs().max())}
    return results


def _bert_spec_error(args) -> str:
    from megatron_2bw.training import specs

    try:
        specs.bert_layer_spec(args)
    except FlagError as error:
        return str(error)
    return "no error"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    return launch.spawn(build_worker, 1, out_dir=tmp_path_factory.mktemp("built"),
                        timeout=120)[0]


def _layer_params(qkv_rows: int, proj_cols: int, fc1_rows: int, ffn: int, norm_bias: bool,
                  bias: dict, qk_norm: int | None = None) -> dict:
    """One transformer layer's parameters as the local spec builds them; ``bias`` maps
    "qkv", "proj", "fc1", "fc2" to whether that linear layer has a bias."""
    params = {
        "input_layernorm.weight": (H,),
        "self_attention.linear_qkv.weight": (qkv_rows, H),
        "self_attention.linear_proj.weight": (H, proj_cols),
        "pre_mlp_layernorm.weight": (H,),
        "mlp.linear_fc1.weight": (fc1_rows, H),
        "mlp.linear_fc2.weight": (H, ffn),
    }
    if norm_bias:
        params |= {"input_layernorm.bias": (H,), "pre_mlp_layernorm.bias": (H,)}
    sizes = {"qkv": qkv_rows, "proj": H, "fc1": fc1_rows, "fc2": H}
    params |= {f"{_LINEAR[k]}.bias": (sizes[k],) for k, on in bias.items() if on}
    if qk_norm:
        for norm in ("q_layernorm", "k_layernorm"):
            params[f"self_attention.{norm}.weight"] = (qk_norm,)
            if norm_bias:
                params[f"self_attention.{norm}.bias"] = (qk_norm,)
    return params


_LINEAR = {"qkv": "self_attention.linear_qkv", "proj": "self_attention.linear_proj",
           "fc1": "mlp.linear_fc1", "fc2": "mlp.linear_fc2"}


def _model_params(layer: dict, norm_bias: bool, position_embeddings: bool,
                  untied: bool) -> dict:
    params = {"embedding.word_embeddings.weight": (VOCAB, H)}
    if position_embeddings:
        params["embedding.position_embeddings.weight"] = (16, H)  # max positions = seq length
    for i in range(LAYERS):
        params |= {f"decoder.layers.{i}.{name}": shape for name, shape in layer.items()}
    params["decoder.final_layernorm.weight"] = (H,)
    if norm_bias:
        params["decoder.final_layernorm.bias"] = (H,)
    if untied:
        params["output_layer.weight"] = (VOCAB, H)
    return params


def test_llama_flags_build_the_llama_structure(built):
    groups, ffn = 2, int((4 * H * 2 / 3) / 64) * 64  # Megatron-LM's SwiGLU default: 64
    layer = _layer_params(qkv_rows=(HEADS + 2 * groups) * HEAD_DIM, proj_cols=HEADS * HEAD_DIM,
                          fc1_rows=2 * ffn, ffn=ffn, norm_bias=False,
                          bias=dict.fromkeys(_LINEAR, False))
    llama = built["llama"]
    assert llama["params"] == _model_params(layer, norm_bias=False, position_embeddings=False,
                                            untied=True)
    assert not any(name.endswith("bias") for name in llama["params"])
    assert set(llama["norms"].values()) == {"RMSNorm"}, llama["norms"]
    assert (llama["activation"], llama["gated"]) == ("silu", True)
    rotary_dim = int(HEAD_DIM * 0.5)  # --rotary-percent 0.5 of each head, --rotary-base 500
    expected = [1.0 / 500 ** (i / rotary_dim) for i in range(0, rotary_dim, 2)]
    assert llama["inv_freq"] == pytest.approx(expected, rel=1e-6)
    assert llama["interpolation"] == 2
    assert math.isfinite(llama["loss"])


def test_default_flags_build_the_gpt2_structure(built):
    ffn = 4 * H
    layer = _layer_params(qkv_rows=3 * H, proj_cols=H, fc1_rows=ffn, ffn=ffn, norm_bias=True,
                          bias=dict.fromkeys(_LINEAR, True))
    default = built["default"]
    assert default["params"] == _model_params(layer, norm_bias=True, position_embeddings=True,
                                              untied=False)  # tied: no output_layer
    assert set(default["norms"].values()) == {"LayerNorm"}
    assert (default["activation"], default["gated"]) == ("gelu", False)
    assert default["softmax_in_fp32"] is False  # Megatron-LM's --attention-softmax-in-fp32
    assert default["norm_eps"] == 1e-5 and default["inv_freq"] is None


def test_other_feature_flags_reach_the_model(built):
    kv, ffn = 16, 4 * H  # --kv-channels 16: projections of heads x 16 = 64
    layer = _layer_params(qkv_rows=3 * HEADS * kv, proj_cols=HEADS * kv, fc1_rows=ffn, ffn=ffn,
                          norm_bias=True, qk_norm=kv,
                          bias={"qkv": True, "proj": False, "fc1": False, "fc2": False})
    variants = built["variants"]
    assert variants["params"] == _model_params(layer, norm_bias=True, position_embeddings=False,
                                               untied=False)
    assert variants["activation"] == "squared_relu" and not variants["gated"]
    assert variants["norm_eps"] == 1e-6 and variants["post_layernorm_residual"] is True
    assert math.isfinite(variants["loss"])
    gelu = built["openai-gelu"]
    assert gelu["activation"] == "openai_gelu" and gelu["softmax_in_fp32"] is True
    assert math.isfinite(gelu["loss"])


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_apply_layernorm_1p_equals_the_plain_norms_with_weight_plus_one(built, normalization):
    result = built["layernorm-1p"][normalization]
    # per layer: input, pre-MLP, query and key norms; and the final norm
    assert result["norm_weights"] == 4 * LAYERS + 1
    assert result["norm_types"] == ["ZeroCenteredNorm"] and result["starts_at_zero"]
    assert result["max_abs_diff"] <= 1e-5 * result["scale"], result


def test_bert_refuses_qk_layernorm(built):
    assert built["bert-qk-layernorm"] == ("--qk-layernorm: megatron-core's BERT layer specs "
                                          "have no query/key norm (GPT only)")


# ---- (b), (c) training ----------------------------------------------------------------------

def _losses(result: launch.Launch) -> dict[int, float]:
    assert result.returncode == 0, f"{' '.join(result.command)}:\n{result.tail(40)}"
    return {record.iteration: record.loss for record in parse_log(result.output).iterations}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[int, float]]:
    """PP=1 (one process, a checkpoint after every iteration), PP=2 flush resumed from the
    PP=1 checkpoint of iteration 1, PP=2 2bw from scratch (6 iterations)."""
    root = tmp_path_factory.mktemp("runs")
    saved, start = root / "pp1", root / "iteration1"
    pp1 = _losses(launch.python(["pretrain_gpt_2bw.py", *TRAIN, "--save", str(saved),
                                 "--save-interval", "1"], timeout=180))
    start.mkdir()
    shutil.copytree(saved / "iter_0000001", start / "iter_0000001")
    (start / "latest_checkpointed_iteration.txt").write_text("1")
    pp2 = ["--pipeline-model-parallel-size", "2"]
    flush = _losses(launch.torchrun(["pretrain_gpt_2bw.py", *TRAIN, *pp2, "--pipeline-schedule",
                                     "flush", "--load", str(start)], 2, timeout=180))
    twobw = _losses(launch.torchrun(["pretrain_gpt_2bw.py", *TRAIN, *pp2, "--pipeline-schedule",
                                     "2bw", "--train-iters", "6"], 2, timeout=180))
    return {"pp1": pp1, "flush": flush, "2bw": twobw}


@pytest.mark.parametrize("schedule", ["2bw", "flush"])
def test_pipeline_runs_train_and_the_loss_falls(runs, schedule):
    losses = runs[schedule]
    first_iteration = 1 if schedule == "2bw" else 2
    assert sorted(losses) == list(range(first_iteration, first_iteration + 6)), losses
    first, last = losses[first_iteration], max(losses)
    assert all(math.isfinite(loss) for loss in losses.values())
    assert (losses[last] + losses[last - 1]) / 2 < first - 0.15, losses


def test_flush_pp2_equals_a_single_process_pp1_run(runs):
    pp1, flush = runs["pp1"], runs["flush"]
    assert sorted(pp1) == list(range(1, ITERS + 1)), pp1
    for iteration in range(2, ITERS + 1):
        assert flush[iteration] == pytest.approx(pp1[iteration], rel=LOSS_RTOL), (
            iteration, flush, pp1)


# ---- (d) bad combinations -------------------------------------------------------------------

BAD = [
    (["--num-query-groups", "2"], 1, "--num-query-groups: needs --group-query-attention"),
    (["--group-query-attention", "--num-query-groups", "3"], 1,
     "--num-query-groups: 4 attention heads do not split into 3 query groups"),
    (["--hidden-size", "48", "--num-attention-heads", "12", "--group-query-attention",
      "--num-query-groups", "3", "--tensor-model-parallel-size", "2"], 2,
     "--num-query-groups: 3 query groups must be a multiple or a divisor of tensor-parallel "
     "size 2"),
    (["--swiglu", "--squared-relu"], 1, "--squared-relu: --swiglu and --squared-relu are "
                                        "exclusive"),
    (["--openai-gelu", "--swiglu"], 1,
     "--openai-gelu: exclusive with --swiglu and --squared-relu"),
    (["--swiglu", "--hidden-size", "16"], 1,
     "--swiglu: the default FFN size int((4 x 16 x 2/3) / 64) x 64 is 0 for hidden sizes "
     "below 24; give --ffn-hidden-size"),
    (["--ffn-hidden-size", "33", "--tensor-model-parallel-size", "2"], 2,
     "--ffn-hidden-size: 33 is not divisible by tensor-parallel size 2"),
    (["--no-position-embedding"], 1, "--no-position-embedding: deprecated (Megatron-LM accepts "
                                     "it only with rope); use --position-embedding-type none"),
    (["--rotary-percent", "0"], 1, "--rotary-percent: expected a finite number in (0, 1], "
                                   "got '0'"),
]


@pytest.mark.parametrize("flags,world,line", BAD, ids=[line.split(":")[0] + f"-{i}"
                                                       for i, (_, _, line) in enumerate(BAD)])
def test_bad_combination_is_one_flag_error(flags, world, line):
    with pytest.raises(FlagError) as error:
        parse_args([*TINY, *flags], world_size=world)
    assert str(error.value) == line


def test_entry_script_prints_the_flag_error_as_one_line():
    result = launch.python(["pretrain_gpt_2bw.py", *TINY, "--num-query-groups", "2"], timeout=60)
    assert result.returncode == 2, result.output
    assert result.output.strip().splitlines() == [
        "error: --num-query-groups: needs --group-query-attention"]


# ---- derived values, as Megatron-LM's validate_args derives them ------------------------------

def test_megatron_lm_derivations():
    llama = parse_args([*TINY, *LLAMA], world_size=1)
    assert llama.ffn_hidden_size == 64 and llama.kv_channels == 8
    assert (llama.num_query_groups, llama.add_bias_linear, llama.add_qkv_bias) == (2, False, False)
    plain = parse_args([*TINY, "--group-query-attention"], world_size=1)
    assert plain.num_query_groups == 1  # Megatron-LM's default for --num-query-groups
    assert plain.ffn_hidden_size == 4 * H and plain.add_qkv_bias  # in sync with the biases
    legacy = parse_args([*TINY, "--use-rotary-position-embeddings", "--no-position-embedding"],
                        world_size=1)
    assert legacy.position_embedding_type == "rope"
    scaled = parse_args([*TINY, "--apply-query-key-layer-scaling"], world_size=1)
    assert scaled.attention_softmax_in_fp32
    tp1 = parse_args([*TINY, "--sequence-parallel"], world_size=1)
    assert tp1.sequence_parallel is False  # off with TP=1, as Megatron-LM
    tp2 = parse_args([*TINY, "--sequence-parallel", "--tensor-model-parallel-size", "2"],
                     world_size=2)  # the CPU's norms refuse it: off, with a note
    assert tp2.sequence_parallel is False
    assert any(note.startswith("note: --sequence-parallel has no effect on CPU")
               for note in tp2.flag_notes)
