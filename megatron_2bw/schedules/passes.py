"""The executor's handlers of the compute actions: F (forward), B (backward), I (input
gradient, the weight-gradient GEMMs deferred) and W (those GEMMs).

:class:`Passes` runs each on the microbatch's weight version (PipeMare's corrected weights
for a backward reading a newer version than its forward) and decides, per action, whether
the chunk's gradients complete in it (its last B, or its last I and W) or run under
``config.no_sync_func``. Invariant: no host synchronisation per microbatch; the only
collectives started here are megatron-core's (a chunk's parameter all-gathers, its gradient
bucket reductions), at the same action of the program on every data-parallel rank.
"""

from __future__ import annotations

import contextlib

import torch

from megatron_2bw.schedules import Action
from megatron_2bw.schedules.call import Call
from megatron_2bw.schedules.moe_microbatches import aux_loss_scale_for_backward
from megatron_2bw.schedules.wgrad import WeightGradStore

__all__ = ["Passes"]


class Passes:
    """The runner's F, B, I and W. Needs ``versions``, ``correction``, ``stash``,
    ``forward_read``, ``weight_grads``, ``wgrad_stores``, ``aux_losses`` and ``stage``, and
    the :class:`~megatron_2bw.schedules.mailbox.Mailbox` methods."""

    def _forward(self, action: Action, call: Call) -> None:
        """F: the microbatch's forward on its version; the output goes to the next virtual
        stage, (input, output) to the stash until the backward."""
        from megatron.core.pipeline_parallel.schedules import forward_step

        if self.versions is not None:
            self.versions.use(action.version)
        k, m, c = action.microbatch, call.num_microbatches, action.chunk
        if call.gathers_next_chunk_at.get(c + 1) is action:
            call.config.param_sync_func[c + 1](call.models[c + 1].parameters())
        input_tensor = self._input(k, c)

        def run():
            return forward_step(
                call.forward_step_func, call.data_iterators[c], call.models[c], m, input_tensor,
                call.losses, call.config, 1, is_first_microbatch=k % m == 0,
                current_microbatch=k % m, vp_stage=self._vp_stage(c),
                is_last_stage=self._last(c))

        # a MoE model's aux losses booked to the microbatch's batch (training.moe)
        output, num_tokens = run() if self.aux_losses is None else \
            self.aux_losses.forward(k // m, run)
        call.num_tokens += num_tokens
        self._give("activation", k, c, 1, output)
        self.stash[k, c] = (input_tensor, output)
        self.forward_read[k, c] = action.version

    def _backward_inputs(self, action: Action, call: Call) -> tuple:
        """For a B or an I: the microbatch's version in use, and its stashed (input, output)
        with the received output gradient (None on the last stage: the output is the loss).
        Under PipeMare's T2 a backward reading a newer version than its forward reads the
        corrected weights, W(version) - (tau_fwd - tau_bkwd) * delta. A MoE model's aux-loss
        gradient scale is set for this backward (``training.moe``: not the one the last
        forward left, which under 2BW may be another step's)."""
        k, c = action.microbatch, action.chunk
        if getattr(call.config, "num_moe_experts", None):
            aux_loss_scale_for_backward(call.config, call.num_microbatches)
        scale = action.version - self.forward_read.pop((k, c))  # tau_fwd - tau_bkwd
        if self.correction is not None and scale > 0:
            self.correction.use(action.version, scale)
        elif self.versions is not None:
            self.versions.use(action.version)
        output_grad = self._output_grad(k, c)
        input_tensor, output = self.stash.pop((k, c))
        return input_tensor, output, output_grad

    def _backward(self, action: Action, call: Call) -> None:
        """B: the microbatch's whole backward; the input gradient goes to the previous
        virtual stage."""
        from megatron.core.enums import ModelType
        from megatron.core.pipeline_parallel.schedules import backward_step

        k = action.microbatch
        input_tensor, output, output_grad = self._backward_inputs(action, call)
        with self._param_grads(action, call):
            input_grad = backward_step(input_tensor, output, output_grad,
                                       ModelType.encoder_or_decoder, call.config)
        if not self._first(action.chunk):
            self._give("grad", k, action.chunk, -1, input_grad)

    def _input_grad(self, action: Action, call: Call) -> None:
        """I: the input gradient and the small parameters' gradients; the linear layers'
        weight-gradient GEMMs wait in the chunk's store for the W."""
        k, c = action.microbatch, action.chunk
        input_tensor, output, output_grad = self._backward_inputs(action, call)
        if output_grad is None:  # the loss, scaled as Megatron's backward_step does
            if call.config.grad_scale_func is not None:
                output = call.config.grad_scale_func(output)
            output_grad = torch.ones_like(output)
        store = self.wgrad_stores.get(c)
        if store is None:
            store = self.wgrad_stores[c] = WeightGradStore(call.models[c])
        with self._param_grads(action, call):
            self.weight_grads[k, c] = store.input_pass(output, output_grad, input_tensor)
        if not self._first(c):
            self._give("grad", k, c, -1, input_tensor.grad)

    def _weight_grad(self, action: Action, call: Call) -> None:
        """W: the microbatch's deferred weight-gradient GEMMs."""
        if self.versions is not None:
            self.versions.use(action.version)
        pending = self.weight_grads.pop((action.microbatch, action.chunk))
        with self._param_grads(action, call):
            WeightGradStore.weight_pass(pending)

    @contextlib.contextmanager
    def _param_grads(self, action: Action, call: Call):
        """Around a B, I or W: a chunk's completing ones (its last B, or its last I and last W)
        complete that chunk's gradients; all others run under ``config.no_sync_func``. With a
        grad_sync_func (--overlap-grad-reduce, aligned) the chunk's bucket reductions are
        launched right after its last completing one,
        except on the first stage of Megatron's 1F1B (one chunk), which launches them from that
        backward's hooks; with virtual stages every stage launches them after, as megatron-core's
        interleaved schedule does (a chunk's backward gives gradients to its parameters only)."""
        config, c = call.config, action.chunk
        completing = call.completing.get(c, ())
        sync_after = config.grad_sync_func is not None and (len(call.models) > 1
                                                            or self.stage > 0)
        with contextlib.nullcontext() if action in completing and not sync_after \
                else _no_sync(config):
            yield
        if completing and action == completing[-1] and sync_after:
            grad_sync = config.grad_sync_func
            chunk_sync = grad_sync[c] if isinstance(grad_sync, (list, tuple)) else grad_sync
            chunk_sync(call.models[c].parameters())


def _no_sync(config):
    """``config.no_sync_func`` entered for every model chunk (a list with virtual stages)."""
    functions = config.no_sync_func
    if functions is None:
        return contextlib.nullcontext()
    if not isinstance(functions, (list, tuple)):
        return functions()
    stack = contextlib.ExitStack()
    for function in functions:
        stack.enter_context(function())
    return stack
