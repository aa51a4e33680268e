"""Pretrain a GPT model with megatron-core and a megatron-2bw pipeline schedule.

    torchrun --nproc-per-node 2 pretrain_gpt_2bw.py --pipeline-model-parallel-size 2 \
        --data-path data/cache/default/corpus_text_document \
        --tokenizer-model data/cache/default/tokenizer.model ...

Flags are Megatron-LM's (see ``python pretrain_gpt_2bw.py --help``).
"""

from functools import partial

from megatron_2bw import entry
from megatron_2bw.training import specs


def model_provider(config, pre_process: bool, post_process: bool, vp_stage: int | None = None,
                   *, args, vocab_size: int):
    """megatron-core's GPTModel with the layer spec --transformer-impl picks (see
    ``specs.gpt_layer_spec``) and the position-embedding arguments Megatron-LM's
    gpt_builders.py passes; --rotary-seq-len-interpolation-factor reaches the rotary embedding
    as in Megatron-LM's legacy language model (its core path drops it). ``vp_stage``: the
    chunk's virtual pipeline stage (None without virtual stages), whose layers GPTModel builds."""
    from megatron.core.models.gpt import GPTModel

    return GPTModel(
        config=config,
        transformer_layer_spec=specs.gpt_layer_spec(args, config, vp_stage),
        vocab_size=vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
    )


def loss_func(loss_mask, output_tensor, per_token: bool = False):
    """Mean token loss of one microbatch; the reported value is a detached copy (the schedule
    divides the returned loss by the number of microbatches in place). With ``per_token``
    (--calculate-per-token-loss) the summed loss and the token count, as Megatron-LM's
    pretrain_gpt.py returns them: megatron-core divides the gradients by the batch's tokens."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    total, tokens = (losses * mask).sum(), mask.sum()
    mean = (total / tokens).detach().clone()
    if per_token:
        return total, tokens.int(), {"lm loss": mean}
    return total / tokens, {"lm loss": mean}


def forward_step(data_iterator, model):
    """Megatron's forward_step_func contract: returns (output, loss function); the batch's
    tensors are on the training device. ``model`` is one chunk: with virtual stages its
    ``pre_process`` and ``post_process`` say whether it reads tokens or labels (Megatron-LM's
    pretrain_gpt.py asks the pipeline stage, the same outside the V of zb-v and dualpipev)."""
    from megatron.core.utils import unwrap_model

    batch = entry.next_batch(data_iterator, model=unwrap_model(model))
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                   labels=batch["labels"])
    per_token = getattr(unwrap_model(model).config, "calculate_per_token_loss", False)
    return output, partial(loss_func, batch["loss_mask"], per_token=per_token)


def main(argv=None):
    args, tokenizer = entry.setup("gpt", argv)
    vocab_size = entry.padded_vocab(args, tokenizer)
    entry.run(args, partial(model_provider, args=args, vocab_size=vocab_size),
              partial(entry.gpt_data, tokenizer=tokenizer), forward_step, vocab_size)


if __name__ == "__main__":  # required: the checkpoint writer spawns a helper process
    main()
