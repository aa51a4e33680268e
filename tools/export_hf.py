"""Export a megatron-2bw checkpoint to a Hugging Face model folder.

    python tools/export_hf.py --load checkpoints/run --out hf/run [--iteration N]

``--load`` is a --save directory or one ``iter_XXXXXXX`` folder. The folder gets
``config.json``, ``model.safetensors`` and, where the run's tokenizer has a Hugging Face form,
its files. One CPU process builds the model at TP = PP = 1 from the saved flags and
megatron-core's dist_checkpointing reshards the saved tensors into it (under 2BW the newer
weight version); then names map: GPT-2 style -> ``GPT2LMHeadModel``, Llama style ->
``LlamaForCausalLM``, BERT -> ``MegatronBertForPreTraining`` (binary head) or
``MegatronBertForMaskedLM``. Invariant: a checkpoint of any TP/PP/V layout exports to the same
folder; anything without a Hugging Face equivalent here is refused with one line.

The mappings (fused QKV, GLU, Conv1D): docs/megatron_lm_compatibility.md, "Export to Hugging Face".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron_2bw.cli import ToolError, ToolParser, main_guard  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = ToolParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True, help="checkpoint directory (--save) or iter_ folder")
    p.add_argument("--out", required=True, help="Hugging Face model folder to write")
    p.add_argument("--iteration", type=int, default=None, help="the iteration to export")
    return p.parse_args(argv)


def checkpoint_path(load: str, iteration: int | None) -> str:
    """The iter_ folder ``--load``/``--iteration`` name."""
    from megatron_2bw.training import checkpointing

    if os.path.isfile(os.path.join(load, "common.pt")) and iteration is None:
        return load
    if iteration is None:
        iteration = checkpointing.latest_iteration(load)
        if iteration is None:
            raise ToolError("--load", f"{load} holds no checkpoint "
                                      f"(no latest_checkpointed_iteration.txt)")
    path = checkpointing.checkpoint_dir(load, iteration)
    if not os.path.isfile(os.path.join(path, "common.pt")):
        raise ToolError("--load", f"{path} is not a checkpoint (no common.pt)")
    return path


# ---- the architecture the saved flags describe ---------------------------------------------

def architecture(args: argparse.Namespace) -> str:
    """"gpt2", "llama" or "bert"; ToolError naming what has no Hugging Face equivalent."""
    model_type = getattr(args, "model_type", "gpt")
    if model_type not in ("gpt", "bert"):
        _refuse(f"a {model_type} model (only GPT and BERT models export)")
    common = [(args.apply_residual_connection_post_layernorm,
               "--apply-residual-connection-post-layernorm"),
              (args.qk_layernorm, "--qk-layernorm"),
              (getattr(args, "layernorm_zero_centered_gamma", False),
               "--apply-layernorm-1p / zero-centered gamma"),
              (getattr(args, "squared_relu", False), "--squared-relu"),
              (getattr(args, "num_experts", None), "--num-experts")]
    for present, flag in common:
        if present:
            _refuse(flag)
    if model_type == "bert":
        return _check_bert(args)
    if args.position_embedding_type == "learned_absolute":
        return _check_gpt2(args)
    if args.position_embedding_type == "rope":
        return _check_llama(args)
    _refuse(f"--position-embedding-type {args.position_embedding_type}")


def _refuse(what: str):
    raise ToolError("--load", f"{what} has no Hugging Face equivalent (GPT2LMHeadModel: learned "
                              f"positions, LayerNorm, GeLU, biases; LlamaForCausalLM: rope, "
                              f"RMSNorm, SwiGLU, no biases; MegatronBert: BERT with learned "
                              f"positions, LayerNorm, GeLU, biases)")


def _query_groups(args) -> int:
    return args.num_query_groups if args.group_query_attention else args.num_attention_heads


def _check_gpt2(args) -> str:
    heads = args.num_attention_heads
    for bad, what in ((args.normalization != "LayerNorm", f"{args.normalization} with learned "
                                                           f"positions"),
                      (args.swiglu, "--swiglu with learned positions"),
                      (not args.add_bias_linear, "--disable-bias-linear with learned positions"),
                      (_query_groups(args) != heads, "grouped-query attention with learned "
                                                      "positions"),
                      (args.kv_channels * heads != args.hidden_size,
                       f"--kv-channels {args.kv_channels} != hidden / heads")):
        if bad:
            _refuse(what)
    return "gpt2"


def _check_bert(args) -> str:
    """MegatronBert's layers: multi-head attention, biases, LayerNorm, erf GeLU in the MLP as in
    megatron-core's BERT LM head (transformers uses one activation for both)."""
    heads = args.num_attention_heads
    for bad, what in ((args.position_embedding_type != "learned_absolute",
                       f"BERT with --position-embedding-type {args.position_embedding_type}"),
                      (args.normalization != "LayerNorm", f"BERT with {args.normalization}"),
                      (args.swiglu, "BERT with --swiglu"),
                      (getattr(args, "openai_gelu", False), "BERT with --openai-gelu (its LM "
                                                            "head keeps erf GeLU)"),
                      (not args.add_bias_linear, "BERT with --disable-bias-linear"),
                      (_query_groups(args) != heads, "BERT with grouped-query attention"),
                      (args.kv_channels * heads != args.hidden_size,
                       f"--kv-channels {args.kv_channels} != hidden / heads")):
        if bad:
            _refuse(what)
    return "bert"


def _check_llama(args) -> str:
    for bad, what in ((args.normalization != "RMSNorm", f"rope with {args.normalization}"),
                      (not args.swiglu, "rope without --swiglu"),
                      (args.add_bias_linear or args.add_qkv_bias, "rope with linear biases"),
                      (args.rotary_percent != 1.0, f"--rotary-percent {args.rotary_percent}"),
                      (getattr(args, "rotary_interleaved", False), "--rotary-interleaved"),
                      (getattr(args, "use_rope_scaling", False), "--use-rope-scaling"),
                      (args.rotary_seq_len_interpolation_factor is not None,
                       "--rotary-seq-len-interpolation-factor")):
        if bad:
            _refuse(what)
    return "llama"


# ---- the full model, in one process ---------------------------------------------------------

def load_full_model(path: str):
    """(saved flags, megatron-core GPTModel or BertModel at TP = PP = 1 holding the checkpoint's
    "model" weights). Starts a one-process gloo group on the CPU."""
    from megatron_2bw.runtime import distributed
    from megatron_2bw.runtime.device import select_device

    select_device(force_cpu=True)  # the CPU runtime precedes megatron-core's models
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(path)
    saved = common.get("args")
    if not isinstance(saved, argparse.Namespace):
        raise ToolError("--load", f"{path} holds no saved flags (args)")
    args = _single_process_args(saved)
    args.model_type = _model_type(saved, path)
    architecture(args)
    distributed.initialize(1, 1, seed=getattr(args, "seed", 1234), force_cpu=True)
    model = _build(args, _saved_vocab(path))
    metadata = dict(dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {})
    from megatron.core import parallel_state as ps

    metadata["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict(metadata=metadata)},
                                     path)
    model.load_state_dict(loaded["model"])
    return args, model.eval()


def _single_process_args(saved: argparse.Namespace) -> argparse.Namespace:
    """The saved flags at TP = PP = 1, no virtual stages, no recomputation, fp32 compute."""
    args = argparse.Namespace(**vars(saved))
    args.tensor_model_parallel_size = args.pipeline_model_parallel_size = 1
    args.virtual_pipeline_model_parallel_size = None
    args.sequence_parallel = False
    args.recompute_granularity = args.recompute_method = args.recompute_num_layers = None
    args.world_size = args.data_parallel_size = 1
    args.model_type = getattr(args, "model_type", "gpt")
    return args


def _model_type(saved: argparse.Namespace, path: str) -> str:
    """"gpt" or "bert": ours save it in the flags; a Megatron-LM checkpoint (its model_type is
    an enum) is BERT where megatron-core's BertModel names its layers "encoder"."""
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    model_type = getattr(saved, "model_type", None)
    if model_type in ("gpt", "bert"):
        return model_type
    bert = any(key.startswith("encoder.") for key in load_sharded_metadata(path))
    return "bert" if bert else "gpt"


def _saved_vocab(path: str) -> int:
    """The embedding's rows as saved (padded for the saved TP size)."""
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    return load_sharded_metadata(path)["embedding.word_embeddings.weight"].global_shape[0]


def _build(args: argparse.Namespace, vocab_size: int):
    import pretrain_bert_2bw
    import pretrain_gpt_2bw

    from megatron_2bw.training import build

    config = build.transformer_config(args, "cpu", hidden_dropout=0.0, attention_dropout=0.0)
    script = pretrain_bert_2bw if args.model_type == "bert" else pretrain_gpt_2bw
    return script.model_provider(config, True, True, args=args, vocab_size=vocab_size)


# ---- name mapping --------------------------------------------------------------------------

def _qkv(weight, groups: int, query_heads: int, head_dim: int):
    """megatron-core's fused QKV rows (or bias) -> (q, k, v), heads in order."""
    per_group = query_heads // groups
    grouped = weight.reshape(groups, (per_group + 2) * head_dim, *weight.shape[1:])
    q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
    return (t.reshape(-1, *weight.shape[1:]) for t in (q, k, v))


def gpt2_weights(args, state: dict) -> dict:
    """GPT2LMHeadModel's state dict (Conv1D weights are [in, out])."""
    import torch

    out = {"transformer.wte.weight": state["embedding.word_embeddings.weight"],
           "transformer.wpe.weight": state["embedding.position_embeddings.weight"],
           "transformer.ln_f.weight": state["decoder.final_layernorm.weight"],
           "transformer.ln_f.bias": state["decoder.final_layernorm.bias"]}
    heads, d = args.num_attention_heads, args.kv_channels
    for i in range(args.num_layers):
        m, h = f"decoder.layers.{i}.", f"transformer.h.{i}."
        for ours, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
            for kind in ("weight", "bias"):
                out[f"{h}{theirs}.{kind}"] = state[f"{m}{ours}.{kind}"]
        for kind in ("weight", "bias"):
            qkv = _qkv(state[f"{m}self_attention.linear_qkv.{kind}"], heads, heads, d)
            out[f"{h}attn.c_attn.{kind}"] = _conv1d(torch.cat(list(qkv)), kind)
            for ours, theirs in (("self_attention.linear_proj", "attn.c_proj"),
                                 ("mlp.linear_fc1", "mlp.c_fc"), ("mlp.linear_fc2", "mlp.c_proj")):
                out[f"{h}{theirs}.{kind}"] = _conv1d(state[f"{m}{ours}.{kind}"], kind)
    out["lm_head.weight"] = _output_layer(args, state)
    return out


def _conv1d(tensor, kind: str):
    return tensor.t() if kind == "weight" else tensor


def _output_layer(args, state: dict):
    if args.untie_embeddings_and_output_weights:
        return state["output_layer.weight"]
    return state["embedding.word_embeddings.weight"]


def llama_weights(args, state: dict) -> dict:
    """LlamaForCausalLM's state dict."""
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
           "model.norm.weight": state["decoder.final_layernorm.weight"],
           "lm_head.weight": _output_layer(args, state)}
    heads, groups, d = args.num_attention_heads, _query_groups(args), args.kv_channels
    for i in range(args.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[f"{h}input_layernorm.weight"] = state[f"{m}input_layernorm.weight"]
        out[f"{h}post_attention_layernorm.weight"] = state[f"{m}pre_mlp_layernorm.weight"]
        q, k, v = _qkv(state[f"{m}self_attention.linear_qkv.weight"], groups, heads, d)
        out[f"{h}self_attn.q_proj.weight"] = q
        out[f"{h}self_attn.k_proj.weight"] = k
        out[f"{h}self_attn.v_proj.weight"] = v
        out[f"{h}self_attn.o_proj.weight"] = state[f"{m}self_attention.linear_proj.weight"]
        gate, up = state[f"{m}mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[f"{h}mlp.gate_proj.weight"] = gate
        out[f"{h}mlp.up_proj.weight"] = up
        out[f"{h}mlp.down_proj.weight"] = state[f"{m}mlp.linear_fc2.weight"]
    return out


def bert_weights(args, state: dict) -> dict:
    """MegatronBertForPreTraining's state dict (binary head), or MegatronBertForMaskedLM's: no
    pooler and sentence-order head; token types then have no effect (zero rows)."""
    import torch

    out = {"bert.embeddings.word_embeddings.weight": state["embedding.word_embeddings.weight"],
           "bert.embeddings.position_embeddings.weight":
               state["embedding.position_embeddings.weight"],
           "bert.embeddings.token_type_embeddings.weight": state.get(
               "embedding.tokentype_embeddings.weight", torch.zeros(2, args.hidden_size)),
           "cls.predictions.decoder.weight": _output_layer(args, state),
           "cls.predictions.bias": state["output_layer.bias"],
           "cls.predictions.decoder.bias": state["output_layer.bias"]}
    renamed = {"encoder.final_layernorm": "bert.encoder.ln",
               "lm_head.dense": "cls.predictions.transform.dense",
               "lm_head.layer_norm": "cls.predictions.transform.LayerNorm"}
    if args.bert_binary_head:
        renamed.update({"pooler.dense": "bert.pooler.dense", "binary_head": "cls.seq_relationship"})
    heads, d = args.num_attention_heads, args.kv_channels
    for i in range(args.num_layers):
        m, h = f"encoder.layers.{i}.", f"bert.encoder.layer.{i}."
        renamed.update({f"{m}input_layernorm": f"{h}attention.ln",
                        f"{m}self_attention.linear_proj": f"{h}attention.output.dense",
                        f"{m}pre_mlp_layernorm": f"{h}ln",
                        f"{m}mlp.linear_fc1": f"{h}intermediate.dense",
                        f"{m}mlp.linear_fc2": f"{h}output.dense"})
        for kind in ("weight", "bias"):
            q, k, v = _qkv(state[f"{m}self_attention.linear_qkv.{kind}"], heads, heads, d)
            for name, tensor in (("query", q), ("key", k), ("value", v)):
                out[f"{h}attention.self.{name}.{kind}"] = tensor
    for ours, theirs in renamed.items():
        for kind in ("weight", "bias"):
            out[f"{theirs}.{kind}"] = state[f"{ours}.{kind}"]
    return out


WEIGHTS = {"gpt2": gpt2_weights, "llama": llama_weights, "bert": bert_weights}
# the output layer's weight, made by transformers from the embedding when tied
TIED_OUTPUT = {"gpt2": "lm_head.weight", "llama": "lm_head.weight",
               "bert": "cls.predictions.decoder.weight"}


def hf_config(kind: str, args, vocab_size: int, dtype) -> dict:
    """config.json's fields for the architecture."""
    common = {"vocab_size": vocab_size,
              "tie_word_embeddings": not args.untie_embeddings_and_output_weights,
              "torch_dtype": str(dtype).removeprefix("torch."),
              "dtype": str(dtype).removeprefix("torch.")}
    if kind == "gpt2":
        gelu = "gelu_new" if getattr(args, "openai_gelu", False) else "gelu"  # tanh / erf
        return {**common, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                "n_embd": args.hidden_size, "n_layer": args.num_layers,
                "n_head": args.num_attention_heads, "n_inner": args.ffn_hidden_size,
                "n_positions": args.max_position_embeddings,
                "layer_norm_epsilon": args.layernorm_epsilon, "activation_function": gelu,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                "scale_attn_weights": True}
    if kind == "bert":
        head = "ForPreTraining" if args.bert_binary_head else "ForMaskedLM"
        return {**common, "architectures": [f"MegatronBert{head}"],
                "model_type": "megatron-bert", "hidden_size": args.hidden_size,
                "num_hidden_layers": args.num_layers,
                "num_attention_heads": args.num_attention_heads,
                "intermediate_size": args.ffn_hidden_size, "hidden_act": "gelu",
                "max_position_embeddings": args.max_position_embeddings, "type_vocab_size": 2,
                "layer_norm_eps": args.layernorm_epsilon, "position_embedding_type": "absolute",
                "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    return {**common, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": args.hidden_size, "intermediate_size": args.ffn_hidden_size,
            "num_hidden_layers": args.num_layers,
            "num_attention_heads": args.num_attention_heads,
            "num_key_value_heads": _query_groups(args), "head_dim": args.kv_channels,
            "max_position_embeddings": args.max_position_embeddings,
            "rms_norm_eps": args.layernorm_epsilon, "hidden_act": "silu",
            "rope_theta": float(args.rotary_base),
            "rope_parameters": {"rope_type": "default", "rope_theta": float(args.rotary_base)},
            "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0}


# ---- tokenizer files -----------------------------------------------------------------------

def write_tokenizer(args, out: Path) -> tuple[str, dict]:
    """The run's tokenizer in Hugging Face form, where it has one: (what was written, its
    bos/eos ids for config.json)."""
    kind = args.tokenizer_type
    tokenizer = None
    if kind == "GPT2BPETokenizer" and args.vocab_file and args.merge_file:
        tokenizer = _gpt2_bpe(args.vocab_file, args.merge_file)
    elif kind.startswith("BertWordPiece") and args.vocab_file:
        tokenizer = _wordpiece(kind, args.vocab_file, getattr(args, "vocab_extra_ids", 0) or 0)
    elif kind == "HuggingFaceTokenizer" and args.tokenizer_model:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_model)
    elif kind in ("GPTSentencePieceTokenizer", "SentencePieceTokenizer", "Llama2Tokenizer") \
            and args.tokenizer_model and os.path.isfile(args.tokenizer_model):
        tokenizer = _sentencepiece(args.tokenizer_model, out)
    if tokenizer is None:
        return (f"no tokenizer files ({kind} has no Hugging Face form here)",
                {"bos_token_id": None, "eos_token_id": None})
    tokenizer.save_pretrained(str(out))
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    if kind.startswith("BertWordPiece"):
        ids["pad_token_id"] = tokenizer.pad_token_id
    return f"{kind} as {type(tokenizer).__name__}", ids


def _gpt2_bpe(vocab_file: str, merge_file: str):
    """GPT-2's byte-level BPE from vocab.json and merges.txt (GPT-2's regex pre-split, no
    prefix space), <|endoftext|> its bos/eos/unk as in GPT-2's own folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    end = "<|endoftext|>"
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=end, eos_token=end,
                                   unk_token=end)


def _wordpiece(kind: str, vocab_file: str, extra_ids: int):
    """BERT's WordPiece over the run's vocabulary (megatron_2bw.data's, Megatron-LM's ids: the
    file's tokens, [BOS], [EOS], the extra ids), with BERT's normalization and pre-split as
    Megatron-LM's FullTokenizer does them (lower-casing and accent stripping for
    BertWordPieceLowerCase), words over 200 characters one [UNK], and [CLS] A [SEP] (B [SEP])
    around the text as BERT's own tokenizer adds them."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from megatron_2bw.data.tokenizer import build_tokenizer
    from megatron_2bw.data.vocab_tokenizers import MAX_WORD_CHARS

    vocab = build_tokenizer(kind, vocab_file=vocab_file, vocab_extra_ids=extra_ids).vocab
    lower = kind == "BertWordPieceLowerCase"
    wordpiece = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]",
                                           max_input_chars_per_word=MAX_WORD_CHARS))
    wordpiece.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                      strip_accents=lower, lowercase=lower)
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wordpiece.decoder = decoders.WordPiece(prefix="##")
    wordpiece.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0", pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    extras = [f"<extra_id_{n}>" for n in range(extra_ids)]
    return PreTrainedTokenizerFast(
        tokenizer_object=wordpiece, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
        cls_token="[CLS]", mask_token="[MASK]", bos_token="[BOS]", eos_token="[EOS]",
        additional_special_tokens=extras)


def _sentencepiece(model_file: str, out: Path):
    """The sentencepiece model as transformers' LlamaTokenizer (its tokenizer.model beside a
    config): plain encoding without bos/eos and no extra prefix space, the ids megatron-core's
    GPTSentencePieceTokenizer / Llama2Tokenizer give (and SentencePieceTokenizer's for text
    without its BERT specials)."""
    import sentencepiece
    from transformers import AutoTokenizer

    pieces = sentencepiece.SentencePieceProcessor(model_file=model_file)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(model_file, out / "tokenizer.model")
    special = {name: pieces.id_to_piece(index) for name, index in
               (("bos_token", pieces.bos_id()), ("eos_token", pieces.eos_id()),
                ("unk_token", pieces.unk_id())) if index >= 0}
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False,
              "add_eos_token": False, "add_prefix_space": False, "legacy": False, **special}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return AutoTokenizer.from_pretrained(str(out))


# ---- the command ---------------------------------------------------------------------------

def export(load: str, out: str, iteration: int | None = None) -> str:
    """Write the folder; returns the architecture's Hugging Face class name."""
    path = checkpoint_path(load, iteration)
    args, model = load_full_model(path)
    name = write_folder(args, model, Path(out))
    print(f"exported {path} as {name} to {out}", flush=True)
    return name


def write_folder(args: argparse.Namespace, model, folder: Path) -> str:
    """config.json, model.safetensors and the tokenizer files of ``model`` (the GPTModel or
    BertModel :func:`load_full_model` built from the saved flags ``args``); the class name."""
    from safetensors.torch import save_file

    kind = architecture(args)
    state = {k: v for k, v in model.state_dict().items() if "_extra_state" not in k}
    weights = WEIGHTS[kind](args, state)
    if not args.untie_embeddings_and_output_weights:
        weights.pop(TIED_OUTPUT[kind])  # tied: transformers makes it from the embedding
    weights = {k: v.detach().contiguous().clone() for k, v in weights.items()}
    embedding = state["embedding.word_embeddings.weight"]
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokenizer, special_ids = write_tokenizer(args, folder)
    config = {**hf_config(kind, args, embedding.shape[0], embedding.dtype), **special_ids}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"tokenizer: {tokenizer}", flush=True)
    return config["architectures"][0]


@main_guard
def main(argv=None) -> None:
    flags = parse(argv)
    export(flags.load, flags.out, flags.iteration)


if __name__ == "__main__":
    main()
