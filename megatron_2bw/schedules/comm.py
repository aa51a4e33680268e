"""Communication as schedule data: a pure pass that puts each stage's transfers into fused groups.

A stage's *program* is its action list with `Exchange`s between the actions; an exchange is one
``torch.distributed.batch_isend_irecv`` group (every send the action before it produced and
every receive the action after it needs), Megatron's ``P2PCommunicator`` pattern derived from
the order:

    stage 0  F0v0 {sa0:1} F1v0 {sa1:1 rg0:1} B0v0 {rg1:1} B1v0 S1
    stage 1  {ra0:0} F0v0 B0v0 {sg0:0 ra1:0} F1v0 B1v0 {sg1:0} S1

Invariants, for every pair of neighbours (the simulator's NCCL mode checks them): both sides see
each other's transfers in the same order; every transfer completes within one call (2BW's
look-ahead activation is received early, before the step); the step never shares a group.
Why: docs/executor.md, "Programs", and docs/schedules.md, "Communication that holds on NCCL".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Sequence, Union

from .actions import SENDS_GRAD, Action, Comms, Kind, Placement, communication

__all__ = ["Transfer", "Exchange", "Step", "fuse", "unbatched", "actions_of", "transfers_of",
           "reads_from"]


@dataclass(frozen=True)
class Transfer:
    """One send or receive of a pipeline tensor between neighbouring stages."""

    op: Literal["send", "recv"]
    peer: int
    """Stage at the other end."""
    tensor: Literal["activation", "grad"]
    """A forward output (to stage+1) or an input gradient (to stage-1)."""
    microbatch: int
    chunk: int = 0
    """Model chunk of the sending side's action (`actions.P2P.chunk`); not written when 0."""

    def __str__(self) -> str:
        chunk = f"c{self.chunk}" if self.chunk else ""
        return f"{self.op[0]}{self.tensor[0]}{self.microbatch}{chunk}:{self.peer}"

    @property
    def key(self) -> tuple[str, int, int]:
        """What the transfer carries, the same on both sides: (tensor, microbatch, chunk)."""
        return self.tensor, self.microbatch, self.chunk

    def describe(self) -> str:
        what = "activation" if self.tensor == "activation" else "gradient"
        direction = "to" if self.op == "send" else "from"
        chunk = f" (chunk {self.chunk})" if self.chunk else ""
        return (f"{self.op} {what} of microbatch {self.microbatch}{chunk} {direction} stage "
                f"{self.peer}")


@dataclass(frozen=True)
class Exchange:
    """One fused group of transfers (``batch_isend_irecv``); it completes when every transfer
    in it met its peer's matching one."""

    transfers: tuple[Transfer, ...]

    def __str__(self) -> str:
        return "{" + " ".join(str(t) for t in self.transfers) + "}"


Step = Union[Action, Exchange]


def _sends(comms: Comms) -> list[Transfer]:
    s = comms.send
    return [] if s is None else [Transfer("send", s.peer, s.tensor, s.microbatch, s.chunk)]


def _recvs(comms: Comms) -> list[Transfer]:
    r = comms.recv
    return [] if r is None else [Transfer("recv", r.peer, r.tensor, r.microbatch, r.chunk)]


def _ordered(transfers: list[Transfer]) -> tuple[Transfer, ...]:
    """Megatron's order inside a group: previous stage first, sends before receives; stable,
    so two transfers on one channel keep the order they were produced in."""
    return tuple(sorted(transfers, key=lambda t: (t.peer, t.op != "send")))


def _sent(actions: Sequence[Action], stage: int, peer: int,
          placement: Placement) -> list[tuple[str, int, int]]:
    """(tensor, microbatch, chunk) that `stage`'s list sends to stage `peer`, in order."""
    found = []
    for c in communication(actions, stage, placement.depth, placement=placement):
        if c.send is not None and c.send.peer == peer:
            found.append((c.send.tensor, c.send.microbatch, c.send.chunk))
    return found


def fuse(actions: Sequence[Action], stage: int, depth: int,
         neighbours: dict[int, Sequence[Action]], *, chunks: int = 1,
         placement: Placement | None = None) -> list[Step]:
    """`stage`'s program for one call: its `actions` with the exchanges between them.

    `neighbours` maps each neighbouring stage (`placement.peers`) to its action list in the
    same call. Every send goes in the exchange right after its action (W and S send nothing;
    around W: `_around_weight_grads`). A tensor a neighbour sends in this call that this list
    uses only in the next is received *early*, in the exchange before the step. Receives from
    one neighbour are posted in the order it sends (a receive also takes, early, whatever the
    neighbour sent before it on that channel), as NCCL matches a pair's transfers in order."""
    placement = placement or Placement(depth, chunks)
    if placement.shape == "v":
        return _fuse_pairwise(actions, stage, neighbours, placement)
    comms = communication(actions, stage, depth, placement=placement)
    sent_order = {peer: _sent(peer_actions, peer, stage, placement)
                  for peer, peer_actions in neighbours.items()}
    sent_here = {peer: set(keys) for peer, keys in sent_order.items()}
    used = {(c.recv.tensor, c.recv.microbatch, c.recv.chunk) for c in comms if c.recv is not None}
    early = [Transfer("recv", peer, *key) for peer in sorted(sent_here)
             for key in sorted(sent_here[peer] - used, key=lambda x: (x[1], x[2]))]
    received: set[tuple[int, tuple[str, int, int]]] = set()

    def in_sender_order(receives: list[Transfer]) -> list[Transfer]:
        """`receives` with what their senders send before them and this list has not
        received yet, in the senders' order."""
        out = []
        for t in receives:
            sent = sent_order[t.peer]
            for key in sent[:sent.index(t.key) + 1]:
                if (t.peer, key) not in received:
                    received.add((t.peer, key))
                    out.append(Transfer("recv", t.peer, *key))
        return out

    program: list[Step] = []
    pending: list[Transfer] = []
    held: list[Action] = []  # weight gradients since the last communicating action
    for action, c in zip(actions, comms):
        if action.kind is Kind.WEIGHT_GRAD:
            held.append(action)
            continue
        receives = in_sender_order([t for t in _recvs(c) if t.key in sent_here[t.peer]])
        if action.kind is Kind.STEP:
            receives = [t for t in early if (t.peer, t.key) not in received]
            early = []
        if held:
            program += _around_weight_grads(pending, held, receives)
        elif pending or receives:
            program.append(Exchange(_ordered(pending + receives)))
        program.append(action)
        pending, held = _sends(c), []
    early = [t for t in early if (t.peer, t.key) not in received]
    if pending or early:  # a list without a step (forward only)
        program.append(Exchange(_ordered(pending + early)))
    program += held
    if placement.shape == "loop" and placement.chunks > 1:
        return _one_exchange_per_pair(program)
    return program


def _fuse_pairwise(actions: Sequence[Action], stage: int,
                   neighbours: dict[int, Sequence[Action]], placement: Placement) -> list[Step]:
    """The V's programs (`fuse`), built pair by pair: both stages of a pair derive the same
    groups from the two lists (`_pair_groups`), so each group on one side meets its mirror on
    the other. In the V one channel carries two kinds of tensor (stage i sends stage i+1 chunk
    0's activations and chunk 1's input gradients, and receives the other two), which the
    action-by-action pass above would interleave differently on the two sides. Each group is
    its own exchange, also where two fall between the same two actions: a group on one side
    then meets exactly one group on the other (one that met two would wait, as a fused NCCL
    group does in the tests' strict mode, for the later one before the earlier could end)."""
    before: dict[int, list[Exchange]] = {}  # position in `actions` -> the groups before it
    for peer, peer_actions in sorted(neighbours.items()):
        low, high = sorted([(stage, actions), (peer, peer_actions)], key=lambda x: x[0])
        for low_gap, high_gap, down, up in _pair_groups(*low, *high, placement):
            mine = stage == low[0]
            transfers = ([Transfer("send", peer, *k) for k in (down if mine else up)]
                         + [Transfer("recv", peer, *k) for k in (up if mine else down)])
            before.setdefault(low_gap if mine else high_gap, []).append(
                Exchange(_ordered(transfers)))
    program: list[Step] = []
    for position, action in enumerate([*actions, None]):
        program += before.get(position, [])
        if action is not None:
            program.append(action)
    return program


def _pair_groups(low: int, low_actions: Sequence[Action], high: int,
                 high_actions: Sequence[Action], placement: Placement) -> list[tuple]:
    """The fused groups between stages `low` < `high`, in order, each (position in low's list
    it goes before, the same in high's, keys sent down, keys sent up).

    Each direction is one in-order channel. Walking both, the next tensor down x and up y go
    in one group when each side makes its tensor before it needs the other's (x sent with y
    received, as Megatron's send_forward_recv_backward); else the one the other side needs
    first goes alone. A group that only sends sits right after its sends are made, one that
    only receives right before its receives are needed (the need of a tensor being the
    earliest need of it and every tensor after it on its channel); a group of both sits where
    `low` needs y and right after `high` made y (of the four such choices the fastest under
    rendezvous on the simulator for ZB-V, within 5% of the fastest for DualPipeV); never before
    an earlier group."""
    down = _channel(low_actions, low, high_actions, high, placement)
    up = _channel(high_actions, high, low_actions, low, placement)
    groups, i, j, last_low, last_high = [], 0, 0, 0, 0
    while i < len(down) or j < len(up):
        x = down[i] if i < len(down) else None  # (key, made on low, needed on high)
        y = up[j] if j < len(up) else None  # (key, made on high, needed on low)
        both = x is not None and y is not None and x[1] <= y[2] and y[1] <= x[2]
        if both:  # low posts it when it needs y, high as soon as it made y
            low_gap, high_gap, sent_down, sent_up = y[2], y[1], [x[0]], [y[0]]
        elif x is not None and (y is None or y[1] > x[2]):
            low_gap, high_gap, sent_down, sent_up = x[1], x[2], [x[0]], []
        elif y is not None and (x is None or x[1] > y[2]):
            low_gap, high_gap, sent_down, sent_up = y[2], y[1], [], [y[0]]
        else:
            raise ValueError(f"stages {low} and {high} each need the other's tensor before "
                             f"they make theirs: {x[0]} and {y[0]}")
        low_gap, high_gap = max(low_gap, last_low), max(high_gap, last_high)
        groups.append((low_gap, high_gap, sent_down, sent_up))
        i, j = i + len(sent_down), j + len(sent_up)
        last_low, last_high = low_gap, high_gap
    return groups


def _channel(sender_actions: Sequence[Action], sender: int, receiver_actions: Sequence[Action],
             receiver: int, placement: Placement) -> list[tuple[tuple[str, int, int], int, int]]:
    """The tensors `sender` sends `receiver`, in order: (key, position in the sender's list
    after the action that makes it, position in the receiver's list of the first action that
    needs it or a later tensor of the channel)."""
    needed = {}
    for j, c in enumerate(communication(receiver_actions, receiver, placement.depth,
                                        placement=placement)):
        if c.recv is not None and c.recv.peer == sender:
            needed[c.recv.tensor, c.recv.microbatch, c.recv.chunk] = j
    sent = [(key, j + 1) for j, key in _sent_at(sender_actions, sender, receiver, placement)]
    channel, earliest_need = [], len(receiver_actions)
    for key, made in reversed(sent):
        earliest_need = min(earliest_need, needed[key])
        channel.append((key, made, earliest_need))
    return channel[::-1]


def _sent_at(actions: Sequence[Action], stage: int, peer: int,
             placement: Placement) -> list[tuple[int, tuple[str, int, int]]]:
    """(position, key) of what `stage`'s list sends to `peer`, in order."""
    return [(j, (c.send.tensor, c.send.microbatch, c.send.chunk))
            for j, c in enumerate(communication(actions, stage, placement.depth,
                                                placement=placement))
            if c.send is not None and c.send.peer == peer]


def _one_exchange_per_pair(program: list[Step]) -> list[Step]:
    """Interleaved 1F1B: no exchange between a forward and the backward right after it (a
    steady-state pair); its receives join the exchange before the F and its sends the one
    after the B, as megatron-core's interleaved schedule posts one
    ``send_forward_backward_recv_forward_backward`` per pair. On the ring of virtual stages
    two stages would otherwise each send to the other before receiving from it. A list whose
    forwards all come before its backwards (every microbatch in the warm-up) has no pair."""
    kinds = [step.kind for step in program if isinstance(step, Action)]
    first_backward = kinds.index(Kind.BACKWARD) if Kind.BACKWARD in kinds else len(kinds)
    if Kind.FORWARD not in kinds[first_backward:]:
        return program
    out = list(program)
    i = 1
    while i + 1 < len(out):
        before, step, after = out[i - 1], out[i], out[i + 1]
        if not (isinstance(step, Exchange) and _is(before, Kind.FORWARD)
                and _is(after, Kind.BACKWARD)):
            i += 1
            continue
        sends = [t for t in step.transfers if t.op == "send"]
        receives = [t for t in step.transfers if t.op == "recv"]
        del out[i]  # out[i - 1] is the F, out[i] the B
        if receives:
            if i >= 2 and isinstance(out[i - 2], Exchange):
                out[i - 2] = Exchange(_ordered([*out[i - 2].transfers, *receives]))
            else:
                out.insert(i - 1, Exchange(_ordered(receives)))
                i += 1
        if sends:
            if i + 1 < len(out) and isinstance(out[i + 1], Exchange):
                out[i + 1] = Exchange(_ordered([*sends, *out[i + 1].transfers]))
            else:
                out.insert(i + 1, Exchange(_ordered(sends)))
        i += 1
    return out


def _is(step: Step, kind: Kind) -> bool:
    return isinstance(step, Action) and step.kind is kind


def _around_weight_grads(sends: list[Transfer], weight_grads: list[Action],
                         receives: list[Transfer]) -> list[Step]:
    """The W's between a communicating action (which made `sends`) and the next one (which
    needs `receives`), with their exchanges, one per neighbour: a send to a neighbour this
    stage receives from next goes with that receive after the W's, in one group that mirrors
    the neighbour's (its send_forward_recv_backward, posted after its own next action); any
    other send goes before the W's, so a neighbour waiting for it is not kept waiting. Under
    NCCL's rendezvous this keeps ZB-H1 as fast as with buffered sends (tests)."""
    receiving_from = {t.peer for t in receives}
    now = [t for t in sends if t.peer not in receiving_from]
    steps: list[Step] = [Exchange(_ordered(now))] if now else []
    steps += weight_grads
    for peer in sorted(receiving_from):
        steps.append(Exchange(_ordered([t for t in sends + receives if t.peer == peer])))
    return steps


def unbatched(actions: Sequence[Action], stage: int, depth: int, *,
              chunks: int = 1, placement: Placement | None = None) -> list[Step]:
    """The pattern this pass replaces, for the NCCL-mode tests: every transfer its own group, a
    receive right before its action and a send right after it. NCCL deadlocks on it whenever
    two neighbours both send before they receive."""
    program: list[Step] = []
    for action, c in zip(actions, communication(actions, stage, depth, chunks=chunks,
                                                placement=placement)):
        program += [Exchange((t,)) for t in _recvs(c)]
        program.append(action)
        program += [Exchange((t,)) for t in _sends(c)]
    return program


def actions_of(program: Sequence[Step]) -> list[Action]:
    """The compute actions of a program, in order (the list it was made from)."""
    return [step for step in program if isinstance(step, Action)]


def transfers_of(program: Sequence[Step]) -> list[Transfer]:
    """Every transfer of a program, in issue order."""
    return [t for step in program if isinstance(step, Exchange) for t in step.transfers]


def reads_from(program: Sequence[Step], kept_version: Callable[[int], int]) -> list[int | None]:
    """For each step of a program, the oldest weight version that must exist when it starts:
    an action's own (F, B, I, W; None for a step), and for an exchange that receives, the
    oldest version read from it to the last action its receives feed (None otherwise).

    A deferred weight version is made before the first step that needs it, so before the
    exchange that brings its first reader's input, not between that exchange and the reader:
    every stage then stalls between the same pair of matching groups with each neighbour (a
    consistent cut of the pipeline), and the stages' steps overlap instead of each waiting
    out its neighbour's. A receive kept for the next call (2BW's look-ahead activation) feeds
    that call's forward, which reads ``kept_version(microbatch)``; the rest of the program
    counts then. An exchange receiving a gradient for a later call needs nothing."""
    needs: list[int | None] = []
    for index, step in enumerate(program):
        if isinstance(step, Action):
            needs.append(None if step.kind is Kind.STEP else step.version)
            continue
        reads, end = [], index
        for transfer in (t for t in step.transfers if t.op == "recv"):
            consumer = _consumer(program, index, transfer)
            if consumer is None and transfer.tensor != "activation":
                reads = []
                break
            if consumer is None:
                reads.append(kept_version(transfer.microbatch))
            end = len(program) - 1 if consumer is None else max(end, consumer)
        if end > index:
            reads += [a.version for a in program[index + 1:end + 1]
                      if isinstance(a, Action) and a.kind is not Kind.STEP]
        needs.append(min(reads) if reads else None)
    return needs


def _consumer(program: Sequence[Step], index: int, transfer: Transfer) -> int | None:
    """Position of the first action after `index` that reads what `transfer` receives (the
    forward of an activation, the backward of a gradient), None if the program has none."""
    kinds = (Kind.FORWARD,) if transfer.tensor == "activation" else SENDS_GRAD
    return next((j for j in range(index + 1, len(program))
                 if isinstance(program[j], Action) and program[j].kind in kinds
                 and program[j].microbatch == transfer.microbatch), None)
