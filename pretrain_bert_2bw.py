"""Pretrain a BERT model with megatron-core and a megatron-2bw pipeline schedule.

    torchrun --nproc-per-node 2 pretrain_bert_2bw.py --pipeline-model-parallel-size 2 \
        --data-path data/cache/default/stdlib_text_sentence \
        --tokenizer-type SentencePieceTokenizer \
        --tokenizer-model data/cache/default/tokenizer.model ...

The data is sentence-level (``tools/preprocess_data.py --split-sentences``). Flags are
Megatron-LM's (see ``python pretrain_bert_2bw.py --help``), with its BERT flags
``--bert-no-binary-head``, ``--mask-prob`` and ``--short-seq-prob``. The loss is masked-LM plus,
with the binary head (on by default), sentence-order prediction, as Megatron-LM's
pretrain_bert.py computes them.
"""

import argparse
from functools import partial

import torch.nn.functional as F

from megatron_2bw import entry
from megatron_2bw.arguments import build_parser, number_in
from megatron_2bw.training import specs


def parser() -> argparse.ArgumentParser:
    """Megatron-LM's flags with its BERT flags added, and BERT's tokenizer type by default
    (Megatron-LM's pretrain_bert.py ``args_defaults``; see arguments._default_tokenizer_type)."""
    p = build_parser("Pretrain BERT with megatron-2bw", extra_args_provider=_add_bert_args)
    p.set_defaults(tokenizer_defaults_of="bert")
    return p


def _add_bert_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("bert")
    g.add_argument("--bert-no-binary-head", action="store_false", dest="bert_binary_head",
                   help="no sentence-order prediction head (and no token types)")
    g.add_argument("--mask-prob", default=0.15,
                   type=number_in(0, 1, low_open=True, high_open=True),
                   help="fraction of tokens masked for the masked-LM loss")
    g.add_argument("--short-seq-prob", default=0.1,
                   type=number_in(0, 1),
                   help="probability of a sample shorter than --seq-length")


def model_provider(config, pre_process: bool, post_process: bool, vp_stage: int | None = None,
                   *, args, vocab_size: int):
    """megatron-core's BertModel with the layer spec --transformer-impl picks (see
    ``specs.bert_layer_spec``); the binary head brings two token types, as in Megatron-LM.
    BertModel's rotary embedding has a fixed base (10000): another --rotary-base is refused.
    ``vp_stage``: the chunk's virtual pipeline stage (None without virtual stages)."""
    from megatron.core.models.bert.bert_model import BertModel

    from megatron_2bw.flag_types import FlagError

    if args.position_embedding_type == "rope" and args.rotary_base != 10000:
        raise FlagError("--rotary-base", f"BERT's rotary embedding has base 10000 "
                        f"(megatron-core's BertModel takes none), got {args.rotary_base}")
    return BertModel(
        config=config,
        num_tokentypes=2 if args.bert_binary_head else 0,
        transformer_layer_spec=specs.bert_layer_spec(args),
        vocab_size=vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        add_binary_head=args.bert_binary_head,
    )


def loss_func(loss_mask, sentence_order, output_tensor):
    """Masked-LM loss over the masked positions, plus the sentence-order loss with the binary
    head; the reported values are detached copies (the schedule divides the returned loss by
    the number of microbatches in place). A microbatch without masked positions (possible
    for very short samples) adds no masked-LM loss instead of a NaN."""
    lm_losses, sop_logits = output_tensor  # (b, s), (b, 2) or None
    mask = loss_mask.reshape(-1).float()
    lm_loss = (lm_losses.float().reshape(-1) * mask).sum() / mask.sum().clamp(min=1)
    if sop_logits is None:
        return lm_loss, {"lm loss": lm_loss.detach().clone()}
    sop_loss = F.cross_entropy(sop_logits.reshape(-1, 2).float(), sentence_order.reshape(-1),
                               ignore_index=-1)
    return lm_loss + sop_loss, {"lm loss": lm_loss.detach().clone(),
                                "sop loss": sop_loss.detach().clone()}


def forward_step(data_iterator, model):
    """Megatron's forward_step_func contract: returns (output, loss function). Every pipeline
    stage reads the microbatch (each needs the padding mask for its attention layers), every
    tensor on the training device."""
    from megatron.core.utils import unwrap_model

    batch = entry.next_batch(data_iterator, every_stage=True)
    binary_head = unwrap_model(model).add_binary_head
    types = batch["types"] if binary_head else None
    output = model(batch["text"], batch["padding_mask"], tokentype_ids=types,
                   lm_labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"], batch["is_random"])


def main(argv=None):
    args, tokenizer = entry.setup("bert", argv, parser=parser())
    if tokenizer is not None:
        from megatron_2bw.data.bert import check_bert_tokenizer
        from megatron_2bw.data.errors import DataError

        try:
            check_bert_tokenizer(tokenizer)
        except DataError as error:
            entry.fail(error)
    vocab_size = entry.padded_vocab(args, tokenizer)
    entry.run(args, partial(model_provider, args=args, vocab_size=vocab_size),
              partial(entry.bert_data, tokenizer=tokenizer), forward_step, vocab_size)


if __name__ == "__main__":  # required: the checkpoint writer spawns a helper process
    main()
