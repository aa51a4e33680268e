"""The export and megatron-core's side of tests/test_export_hf.py, in a process of its own (it
starts a one-process gloo group):

    python tests/hf_export_worker.py CHECKPOINT_DIR TOKENS.pt OUT.pt NEW_TOKENS HF_DIR

Runs ``python tools/export_hf.py --load CHECKPOINT_DIR --out HF_DIR`` (its main), then loads
the checkpoint's full model at TP = PP = 1 again (dist_checkpointing reshards the saved
TP = 2, PP = 2 shards; a fresh model, not the exporter's), and writes, for a GPT checkpoint,
{"logits": (b, s, V) float32 of megatron-core's GPTModel forward on TOKENS (b, s) with a causal
mask, "greedy": TOKENS extended by NEW_TOKENS argmax steps, each a full forward of the sequence
so far}; for a BERT checkpoint TOKENS.pt holds {"tokens", "padding_mask", "types"} (b, s) and
the output is {"logits": (b, s, V), "sop_logits": (b, 2) or None} of megatron-core's BertModel
forward (token types with the binary head, as pretrain_bert.py passes them).
"""

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

import export_hf  # noqa: E402


def forward(model, tokens: torch.Tensor) -> torch.Tensor:
    """(b, s, V) logits; megatron-core's mask is True where attention is not allowed."""
    s = tokens.shape[1]
    positions = torch.arange(s).unsqueeze(0).expand_as(tokens)
    causal_block = ~torch.tril(torch.ones(1, 1, s, s, dtype=torch.bool))
    with torch.no_grad():
        return model(tokens, positions, causal_block).float()


def bert_forward(model, tokens, padding_mask, types) -> dict:
    """BertModel's MLM logits (b, s, V) and, with the binary head, its SOP logits (b, 2)."""
    with torch.no_grad():
        logits, sop = model(tokens, padding_mask,
                            tokentype_ids=types if model.add_binary_head else None)
    return {"logits": logits.float(), "sop_logits": None if sop is None else sop.float()}


def main(load: str, tokens_path: str, out: str, new_tokens: int, hf_dir: str) -> None:
    export_hf.main(["--load", load, "--out", hf_dir])  # starts the one-process group
    path = export_hf.checkpoint_path(load, None)
    from megatron.core import dist_checkpointing

    saved = dist_checkpointing.load_common_state_dict(path)["args"]
    model = export_hf._build(export_hf._single_process_args(saved), export_hf._saved_vocab(path))
    _load(model.eval(), path)
    model.float()  # fp16/bf16 checkpoints: computed in fp32, as the test runs transformers
    tokens = torch.load(tokens_path)
    if isinstance(tokens, dict):
        torch.save(bert_forward(model, **tokens), out)
        return
    logits = forward(model, tokens)
    greedy = tokens
    for _ in range(new_tokens):
        step = forward(model, greedy)[:, -1].argmax(-1, keepdim=True)
        greedy = torch.cat([greedy, step], dim=1)
    torch.save({"logits": logits, "greedy": greedy}, out)


def _load(model, path: str) -> None:
    """The checkpoint's "model" entries into ``model``, by megatron-core's dist_checkpointing."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    metadata = dict(dist_checkpointing.load_content_metadata(path) or {})
    metadata["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
    sharded = {"model": model.sharded_state_dict(metadata=metadata)}
    model.load_state_dict(dist_checkpointing.load(sharded, path)["model"])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
