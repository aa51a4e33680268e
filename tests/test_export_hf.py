"""Checkpoints of TP = 2, PP = 2 runs (4 CPU processes, 2 iterations, a tiny model on
scripts/examples/prepare_data.py's data), read as Megatron-LM reads them, and exported to
Hugging Face by tools/export_hf.py.

References: the common state and optimizer layout derived from Megatron-LM's code at
core_v0.16.1 (not from ours), and, for the export, megatron-core's own GPTModel / BertModel
forward of the checkpoint: transformers' logits equal it (fp32, rel 1e-5), greedy generation
gives the same tokens, and the exported tokenizer gives the run's ids. Guards: a checkpoint of a
GPT-2-style, Llama-style or BERT run exports to a model that computes what the run's model
computes. The four runs and the layout details: docs/testing.md, "What each test module checks",
test_export_hf.py.
"""

from __future__ import annotations

import argparse
import io
import math
import re
import sys

import pytest
import torch

from tests import dist as launch

SIZES = ["--cpu", "--num-layers", "4", "--hidden-size", "64", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "1",
         "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-2",
         "--lr-decay-style", "constant", "--split", "949,50,1", "--eval-iters", "0",
         "--save-interval", "2", "--log-interval", "1", "--tensor-model-parallel-size", "2",
         "--pipeline-model-parallel-size", "2", "--distributed-timeout-minutes", "1",
         "--num-workers", "0"]
TP = 2
LR = 1e-2
ITERATIONS = 2
# load_checkpoint, check_checkpoint_args and load_args_from_checkpoint (core_v0.16.1): the
# fields of the saved args they read
ARGS_READ = ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples",
             "tensor_model_parallel_size", "pipeline_model_parallel_size", "world_size",
             "data_parallel_size", "no_save_rng", "no_save_optim", "num_layers", "hidden_size",
             "num_attention_heads", "add_position_embedding", "max_position_embeddings",
             "make_vocab_size_divisible_by", "padded_vocab_size", "tokenizer_type",
             "global_batch_size", "ffn_hidden_size", "kv_channels", "num_query_groups",
             "group_query_attention", "normalization", "swiglu", "add_bias_linear",
             "add_qkv_bias", "position_embedding_type", "rotary_base", "rotary_percent",
             "untie_embeddings_and_output_weights", "seq_length", "tokenizer_model")
MEGATRON_COMMON_KEYS = {"args", "checkpoint_version", "iteration", "optimizer",
                        "opt_param_scheduler", "num_floating_point_operations_so_far",
                        "content_metadata"}


def _flags(kind: str, data) -> list[str]:
    if kind == "gpt2":
        return ["--num-attention-heads", "4", "--pipeline-schedule", "2bw",
                "--data-path", str(data / "gpt3" / "my-gpt3_text_document"),
                "--vocab-file", str(data / "gpt2-vocab.json"),
                "--merge-file", str(data / "gpt2-merges.txt")]
    return ["--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2",
            "--kv-channels", "8", "--ffn-hidden-size", "96", "--position-embedding-type",
            "rope", "--rotary-base", "500000", "--normalization", "RMSNorm", "--norm-epsilon",
            "1e-6", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
            "--use-distributed-optimizer", "--pipeline-schedule", "flush",
            "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", str(data / "llama3-tokenizer"),
            "--data-path", str(data / "llama3" / "my-llama3_text_document")]


def _trained(script: str, flags_of, kinds, data, tmp_path_factory) -> dict:
    """{kind: checkpoint root} of one 4-process run of ``script`` per kind."""
    roots = {}
    for kind in kinds:
        root = tmp_path_factory.mktemp(kind) / "checkpoints"
        done = launch.torchrun([script, *SIZES, *flags_of(kind, data), "--save", str(root)], 4,
                               timeout=240)
        assert done.returncode == 0, done.tail(60)
        roots[kind] = root
    return roots


@pytest.fixture(scope="module")
def checkpoints(example_data, tmp_path_factory):
    """{kind: checkpoint root} of the two runs."""
    return _trained("pretrain_gpt_2bw.py", _flags, ("gpt2", "llama"), example_data,
                    tmp_path_factory)


BERT_FILE_TOKENS = 512  # scripts/examples/prepare_data.py's bert-vocab.txt
# _BertWordPieceTokenizer.__init__ / add_token (Megatron-LM core_v0.16.1): the next ids
BERT_BOS, BERT_EOS = BERT_FILE_TOKENS, BERT_FILE_TOKENS + 1
BERT_KINDS = {"bert": [], "bert-mlm": ["--bert-no-binary-head"]}


def _bert_flags(kind: str, data) -> list[str]:
    schedule = "2bw" if kind == "bert" else "flush"
    return ["--num-attention-heads", "4", "--pipeline-schedule", schedule, *BERT_KINDS[kind],
            "--data-path", str(data / "bert" / "my-bert_text_sentence"),
            "--vocab-file", str(data / "bert-vocab.txt")]


@pytest.fixture(scope="module")
def bert_checkpoints(example_data, tmp_path_factory):
    """{kind: checkpoint root} of the two BERT runs."""
    return _trained("pretrain_bert_2bw.py", _bert_flags, BERT_KINDS, example_data,
                    tmp_path_factory)


def _common(root):
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(str(root / "iter_0000002"))


def _saved_objects(path, prefix: str) -> dict:
    """The ShardedObjects under ``prefix`` of a torch_dist checkpoint (torch's own reader)."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    reader = FileSystemReader(str(path))
    keys = [k for k, v in reader.read_metadata().state_dict_metadata.items()
            if k.startswith(prefix) and isinstance(v, BytesStorageMetadata)]
    objects = {k: io.BytesIO() for k in keys}
    load(objects, storage_reader=reader, no_dist=True)
    return {k: v[0] for k, v in objects.items()}


def _megatron_tokenizer_vocab(kind: str, data) -> int:
    """``tokenizer.vocab_size`` as Megatron-LM's tokenizer classes count it: GPT-2's
    vocab.json entries; len(AutoTokenizer) for a HuggingFace folder."""
    import json

    if kind == "gpt2":
        return len(json.loads((data / "gpt2-vocab.json").read_text()))
    if kind == "bert":  # _BertWordPieceTokenizer: the file's lines + [BOS] + [EOS]
        return len((data / "bert-vocab.txt").read_text().splitlines()) + 2
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(data / "llama3-tokenizer")))


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_common_state_is_what_megatron_lm_saves(request, example_data, kind):
    runs = request.getfixturevalue("bert_checkpoints" if kind == "bert" else "checkpoints")
    common = _common(runs[kind])
    assert MEGATRON_COMMON_KEYS <= set(common), sorted(common)
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == ITERATIONS
    args = common["args"]
    missing = [name for name in ARGS_READ if not hasattr(args, name)]
    assert not missing, missing
    multiple = 128 * TP  # --make-vocab-size-divisible-by's default x TP
    padded = math.ceil(_megatron_tokenizer_vocab(kind, example_data) / multiple) * multiple
    assert args.padded_vocab_size == padded
    assert args.tokenizer_type == {"gpt2": "GPT2BPETokenizer",  # pretrain_gpt.py's default
                                   "llama": "HuggingFaceTokenizer",
                                   "bert": "BertWordPieceLowerCase"}[kind]  # pretrain_bert.py's
    # --num-query-groups: the flag's value, else its default 1 (validate_args leaves it)
    assert args.num_query_groups == {"gpt2": 1, "llama": 2, "bert": 1}[kind]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.world_size, args.data_parallel_size) == (2, 2, 4, 1)
    assert (args.consumed_train_samples, args.skipped_train_samples,
            args.consumed_valid_samples) == (8, 0, 0)


@pytest.mark.parametrize("tokenizer, mock", [
    ("GPT2BPETokenizer", False), ("BertWordPieceLowerCase", False),
    ("HuggingFaceTokenizer", False), ("NullTokenizer", False), ("NullTokenizer", True)])
def test_padded_vocab_size_is_megatron_lms_for_every_tokenizer(example_data, tokenizer,
                                                              mock):
    """``_vocab_size_with_padding(tokenizer.vocab_size)`` at TP = 2, the vocabulary as
    Megatron-LM's classes count it: vocab.json's entries, vocab.txt's + 2 (_BertWordPieceTokenizer
    adds [BOS] and [EOS]), len(AutoTokenizer), and --vocab-size + 1 (eod) for _NullTokenizer,
    which Megatron-LM builds under --mock-data too (Megatron-LM's Llama-3 example with MOCK)."""
    import json

    from megatron_2bw import entry
    from megatron_2bw.arguments import parse_args
    from megatron_2bw.data.tokenizer import TokenizerSpec

    files = {"GPT2BPETokenizer": ["--vocab-file", str(example_data / "gpt2-vocab.json"),
                                  "--merge-file", str(example_data / "gpt2-merges.txt")],
             "BertWordPieceLowerCase": ["--vocab-file", str(example_data / "bert-vocab.txt")],
             "HuggingFaceTokenizer": ["--tokenizer-model",
                                      str(example_data / "llama3-tokenizer")],
             "NullTokenizer": ["--vocab-size", "512"]}[tokenizer]
    data = ["--mock-data"] if mock else ["--data-path", "unused"]
    args = parse_args([*SIZES, "--num-attention-heads", "4", "--save", "unused", *data,
                       "--tokenizer-type", tokenizer, *files], world_size=4)
    built = None if mock else TokenizerSpec.from_args(args).build()
    entry.padded_vocab(args, built)
    vocab = {"GPT2BPETokenizer": lambda: len(json.loads(
                 (example_data / "gpt2-vocab.json").read_text())),
             "BertWordPieceLowerCase": lambda: len(
                 (example_data / "bert-vocab.txt").read_text().split()) + 2,
             "HuggingFaceTokenizer": lambda: _megatron_tokenizer_vocab("llama", example_data),
             "NullTokenizer": lambda: 512 + 1}[tokenizer]()
    assert args.padded_vocab_size == math.ceil(vocab / (128 * TP)) * (128 * TP)


def test_distributed_optimizer_param_groups_are_where_megatron_lm_keeps_them(checkpoints):
    root = checkpoints["llama"]
    common = _common(root)
    assert common["optimizer"] == {"param_state_sharding_type": "dp_reshardable"}
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "dp_reshardable"
    objects = _saved_objects(root / "iter_0000002", "optimizer.distributed.")
    groups_objects = {k: v for k, v in objects.items()
                      if re.fullmatch(r"optimizer\.distributed\.dp_group_idx_\d+\.optimizer/.*", k)}
    assert len(groups_objects) == 4, sorted(objects)  # one per (TP, PP) rank's DP group
    for saved in groups_objects.values():
        groups = saved["param_groups"]
        assert sorted(g["wd_mult"] for g in groups) == [0.0, 1.0], groups
        for group in groups:
            assert "params" not in group
            assert group["lr"] == group["max_lr"] == LR and group["min_lr"] == 0.0
            assert group["weight_decay"] == 0.01 * group["wd_mult"]  # --weight-decay's default
            assert group["step"] == ITERATIONS  # torch Adam without apex/TE: the step count


def _export_and_megatron_side(root, tokens: torch.Tensor, tmp_path, new_tokens: int) -> dict:
    """tools/export_hf.py's main into tmp_path/hf, and megatron-core's logits and greedy
    tokens (tests/hf_export_worker.py: one process for both)."""
    tokens_path, out = tmp_path / "tokens.pt", tmp_path / "megatron.pt"
    torch.save(tokens, tokens_path)
    done = launch.python(["tests/hf_export_worker.py", str(root), str(tokens_path), str(out),
                          str(new_tokens), str(tmp_path / "hf")], timeout=120)
    assert done.returncode == 0, done.tail()
    assert re.search(r"^exported .* as \w+ to ", done.output, re.MULTILINE), done.tail()
    return torch.load(out)


def _run_tokenizer(kind: str, data):
    from megatron_2bw.data.tokenizer import build_tokenizer

    if kind == "gpt2":
        return build_tokenizer("GPT2BPETokenizer", vocab_file=str(data / "gpt2-vocab.json"),
                               merge_file=str(data / "gpt2-merges.txt"))
    return build_tokenizer("HuggingFaceTokenizer", str(data / "llama3-tokenizer"))


@pytest.mark.parametrize("kind, hf_class", [("gpt2", "GPT2LMHeadModel"),
                                            ("llama", "LlamaForCausalLM")])
def test_export_gives_the_same_logits_and_tokens(checkpoints, example_data, tmp_path, kind,
                                                 hf_class):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 500, (2, 12), generator=generator)
    megatron = _export_and_megatron_side(checkpoints[kind], tokens, tmp_path, new_tokens=4)
    out = tmp_path / "hf"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= \
        {p.name for p in out.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
    assert type(model).__name__ == hf_class
    with torch.no_grad():
        logits = model(tokens).logits
    torch.testing.assert_close(logits, megatron["logits"], rtol=1e-5, atol=1e-5)
    assert megatron["logits"].std() > 0.1  # trained, not constant
    model.generation_config.eos_token_id = None  # 4 tokens, also past an <|endoftext|>
    generated = model.generate(tokens, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(generated, megatron["greedy"]), (generated, megatron["greedy"])

    text = "def main(argv):\n    return  x + 1  # done"
    exported = AutoTokenizer.from_pretrained(str(out))
    assert exported(text)["input_ids"] == _run_tokenizer(kind, example_data).tokenize(text)


@pytest.mark.parametrize("kind, hf_class", [("bert", "MegatronBertForPreTraining"),
                                            ("bert-mlm", "MegatronBertForMaskedLM")])
def test_bert_export_gives_the_same_mlm_and_sop_logits(bert_checkpoints, example_data, tmp_path,
                                                      kind, hf_class):
    from transformers import AutoModelForMaskedLM, AutoModelForPreTraining, AutoTokenizer

    from megatron_2bw.data.tokenizer import build_tokenizer

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 500, (2, 12), generator=generator)
    padding_mask = torch.ones(2, 12, dtype=torch.long)
    padding_mask[1, 9:] = 0  # the second sample: 9 tokens, then padding
    types = torch.zeros(2, 12, dtype=torch.long)
    types[:, 5:] = 1
    types[1, 9:] = 0
    inputs = {"tokens": tokens, "padding_mask": padding_mask, "types": types}
    megatron = _export_and_megatron_side(bert_checkpoints[kind], inputs, tmp_path, new_tokens=0)
    out = tmp_path / "hf"
    auto = AutoModelForPreTraining if kind == "bert" else AutoModelForMaskedLM
    model = auto.from_pretrained(str(out)).float().eval()
    assert type(model).__name__ == hf_class
    assert model.config.vocab_size == 768  # 512 + [BOS] + [EOS], padded to 128 x TP 2
    with torch.no_grad():
        hf = model(input_ids=tokens, attention_mask=padding_mask, token_type_ids=types)
    real = padding_mask.bool()
    logits = hf.prediction_logits if kind == "bert" else hf.logits
    torch.testing.assert_close(logits[real], megatron["logits"][real], rtol=1e-5, atol=1e-5)
    assert megatron["logits"].std() > 0.1  # trained, not constant
    if kind == "bert":
        torch.testing.assert_close(hf.seq_relationship_logits, megatron["sop_logits"],
                                   rtol=1e-5, atol=1e-5)
        assert not torch.equal(megatron["sop_logits"][0], megatron["sop_logits"][1])
    else:
        assert megatron["sop_logits"] is None

    text = "def main(argv):\n    return  Café(x) + 1  # done, ÉTÉ!"
    exported = AutoTokenizer.from_pretrained(str(out))
    ours = build_tokenizer("BertWordPieceLowerCase",
                           vocab_file=str(example_data / "bert-vocab.txt"))
    assert exported(text)["input_ids"] == [ours.cls, *ours.tokenize(text), ours.sep]
    assert (exported.bos_token_id, exported.eos_token_id) == (BERT_BOS, BERT_EOS)
    assert exported.convert_tokens_to_ids(["[BOS]", "[EOS]"]) == [BERT_BOS, BERT_EOS]
    # Megatron-LM saves args.model_type as its ModelType enum: BERT is told by its tensors
    sys.path.insert(0, str(launch.REPO / "tools"))
    import export_hf

    path = str(bert_checkpoints[kind] / "iter_0000002")
    assert export_hf._model_type(argparse.Namespace(model_type=object()), path) == "bert"


def test_a_model_without_a_hugging_face_equivalent_is_refused_in_one_line():
    """Rope with LayerNorm and GeLU (neither GPT-2 nor Llama): one line, no traceback."""
    sys.path.insert(0, str(launch.REPO / "tools"))
    import export_hf

    from megatron_2bw.arguments import parse_args
    from megatron_2bw.cli import ToolError

    args = parse_args([*SIZES, "--num-attention-heads", "4", "--mock-data", "--save", "unused",
                       "--position-embedding-type", "rope"], world_size=4)
    args.model_type = "gpt"
    with pytest.raises(ToolError, match=r"^--load: rope with LayerNorm has no Hugging Face "
                                        r"equivalent"):
        export_hf.architecture(args)


def test_a_folder_without_a_checkpoint_is_one_line(tmp_path, capsys):
    sys.path.insert(0, str(launch.REPO / "tools"))
    import export_hf

    with pytest.raises(SystemExit) as stop:
        export_hf.main(["--load", str(tmp_path), "--out", str(tmp_path / "hf")])
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --load: {tmp_path} holds no checkpoint (no latest_checkpointed_iteration.txt)"]
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("tokenizer_type", ["GPTSentencePieceTokenizer", "Llama2Tokenizer"])
def test_a_sentencepiece_tokenizer_exports_with_the_same_ids(tiny_gpt_data, tmp_path,
                                                             tokenizer_type):
    from transformers import AutoTokenizer

    from megatron_2bw.data.tokenizer import build_tokenizer

    sys.path.insert(0, str(launch.REPO / "tools"))
    import export_hf

    model = tiny_gpt_data.tokenizer_model
    args = argparse.Namespace(tokenizer_type=tokenizer_type, tokenizer_model=model,
                              vocab_file=None, merge_file=None)
    export_hf.write_tokenizer(args, tmp_path)
    exported = AutoTokenizer.from_pretrained(str(tmp_path))
    ours = build_tokenizer(tokenizer_type, model)
    for text in ("def main(argv):\n    return  x + 1  # done", "Hello World",
                 "  two leading spaces", "tabs\tand\nnew lines", "unicode héllo ✓ 中"):
        assert exported(text)["input_ids"] == ours.tokenize(text), text
