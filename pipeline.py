"""A target split into pipeline stages over MLX's distributed engine, for a model too big for one machine.

    mlx.launch --backend ring --hosts mac1,mac2 python main.py --model t5-11b-8bit --stages 2

Each rank (`mlx.launch` starts one a host) holds a contiguous run of the encoder's layers and one of the decoder's,
cut where the ranks' weights come out even (or as `--stages 14:6,10:18` says), each with a decoder layer. It reads
only its own weights from the converted folder (mapped lazily: no rank ever holds the whole model) and keeps its
own layers' caches.

Rank 0 runs the program: the command line, the server or a script, the draft (whole, on rank 0 alone), every
decoding rule. Its target is a `Pipeline`, whose encoding, caches and decode steps go through the stages; the other
ranks only compute (`work`): they take rank 0's commands in order from the rank before them, apply them to their
layers and caches, and pass them on, and the last stage's output (the encoder's, or the logits) comes back to rank 0.
So every decoding path is the one process's, token for token, and a speculative round's verify of k drafts is one
trip through the stages, as a regular step is.

A rank that fails, or loses a peer, ends its process with one line naming the rank (MLX's ring backend notices a
closed connection within about a second); a rank the others never reach ends after CONNECT_SECONDS.
"""

import argparse
import atexit
import collections
import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass, replace

import cpu  # before mlx.core
import mlx.core as mx
from mlx.utils import tree_flatten

from cache import DecoderCache
from errors import LoadError, StageError
from model import EncoderDecoder, drained

# Commands, as rank 0 sends them down the stages (ROW: one row's cross-attention as a cache of its own; WEIGHTS: a
# pass over it capturing the alignment heads' layers, for Whisper's word times).
ENCODE, CACHE, DECODE, TRIM, KEEP, REORDER, EXTEND, DROP, MEMORY, EXIT, ROW, WEIGHTS = range(12)
DTYPES = (mx.float32, mx.float16, mx.bfloat16, mx.int32)
CONNECT_SECONDS = 30  # how long a rank waits for the others at start (T5_MLX_CONNECT_SECONDS)


@dataclass(frozen=True)
class Command:
    """What rank 0 asks of the stages: `op`, on the cache `cache`, with `sizes` (the payload's (B, L, d); or what
    the op needs), `ints` (rows, trims, ids), and the payload's dtype; `masked`: a padding mask follows the payload."""

    op: int
    cache: int = 0
    sizes: tuple = (0, 0, 0)
    ints: tuple = ()
    dtype: mx.Dtype = mx.float32
    masked: bool = False

    def header(self) -> mx.array:
        return mx.array([self.op, self.cache, *self.sizes, len(self.ints), DTYPES.index(self.dtype), int(self.masked)],
                        mx.int32)


HEADER = 8  # int32s: Command.header


class Link:
    """This rank's place among the stages, and the commands that travel between them: down the line from rank 0 to
    the last rank, each rank taking them from the one before; outputs back to rank 0 from the stage that made them."""

    def __init__(self, group):
        self.group, self.rank, self.size = group, group.rank(), group.size()
        self.parts = None  # each rank's (encoder layers, decoder layers), as ranges: place()
        self.caches = 0  # the last cache id handed out (rank 0)
        self.dropped = collections.deque()  # caches rank 0 let go of (any thread's), dropped with the next command
        self.broken = False  # a peer was lost: nothing more is sent (it could wait forever)

    def checked(self, peer: int | None, work):
        """work(), with MLX's error for a lost connection as a StageError naming the peer."""
        try:
            return work()
        except RuntimeError as e:  # the ring backend's lost connection
            self.broken = True
            lost = "a peer" if peer is None else f"rank {peer}"
            raise StageError(f"stage rank {self.rank} lost {lost} ({' '.join(str(e).split())})") from None

    def send(self, to: int, *arrays: mx.array) -> None:
        mx.eval(*arrays)  # computed first: a failure here is this rank's own, and leaves nothing half sent
        for a in arrays:  # one at a time: sends evaluated together may leave in any order
            self.checked(to, lambda: mx.eval(mx.distributed.send(a, to, group=self.group)))

    def receive(self, source: int, shape, dtype=mx.int32) -> mx.array:
        x = mx.distributed.recv(tuple(shape), dtype, source, group=self.group)
        self.checked(source, lambda: mx.eval(x))
        return x

    def pass_on(self, command: Command, *payloads: mx.array) -> None:
        """A command, and its payloads, to the next stage (if any)."""
        if self.rank + 1 < self.size:
            ints = (mx.array(command.ints, mx.int32),) if command.ints else ()
            self.send(self.rank + 1, command.header(), *ints, *payloads)

    def command(self, command: Command, *payloads: mx.array) -> None:
        """Rank 0's command to every other stage (after the caches it dropped since the last one)."""
        if self.broken:  # a stage is gone: nothing can be decoded any more
            raise StageError(f"stage rank {self.rank} lost a peer earlier: the stages must be started again")
        dropped = []
        while self.dropped:  # (a deque's popleft and append are atomic: garbage collection may add to it meanwhile)
            dropped.append(self.dropped.popleft())
        if dropped:
            self.pass_on(Command(DROP, ints=tuple(dropped)))
        self.pass_on(command, *payloads)

    def next_command(self) -> tuple[Command, list[mx.array]]:
        """The next command from the rank before, and its payloads."""
        op, cache, a, b, c, count, dtype, masked = self.receive(self.rank - 1, (HEADER,)).tolist()
        ints = tuple(self.receive(self.rank - 1, (count,)).tolist()) if count else ()
        command = Command(op, cache, (a, b, c), ints, DTYPES[dtype], bool(masked))
        payloads = []
        if op in (ENCODE, CACHE, DECODE, WEIGHTS):
            payloads.append(self.receive(self.rank - 1, (a, b, c), command.dtype))
            if masked:
                payloads.append(self.receive(self.rank - 1, (a, b)))
        return command, payloads

    def reply(self, out: mx.array) -> None:
        """The last stage's output, back to rank 0 (its neighbour in the ring, to which alone the ring backend sends:
        every output comes back from the last stage)."""
        self.send(0, out)

    def close(self) -> None:
        """The other stages' end, as rank 0's program ends (unless one of them is gone already)."""
        if not self.broken:
            try:
                self.command(Command(EXIT))
            except StageError:
                pass


def stages_option(text: str) -> int | list[tuple[int, int]]:
    """--stages: a count of stages ("2"), or each stage's encoder:decoder layer counts ("14:6,10:18")."""
    try:
        if ":" not in text:
            count = int(text)
            if count >= 1:
                return count
            raise ValueError
        return [(int(e), int(d)) for e, d in (stage.split(":") for stage in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a count of stages (2) nor each stage's "
                                         "encoder:decoder layers (14:6,10:18)") from None


# Watches a rank's start from a process of its own: MLX's init holds the interpreter until every rank has come, so
# no thread of the rank's can give up on them.
WATCHDOG = """
import os, select, signal, sys
pid, seconds, message = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
if not select.select([sys.stdin], [], [], seconds)[0]:
    print(message, file=sys.stderr, flush=True)
    os.kill(pid, signal.SIGKILL)
"""


def connected(seconds: float | None = None):
    """MLX's distributed group, once every rank has answered: a rank that waits longer than `seconds` for the others
    (a host down or unreachable, a rank that never started) is ended, with one line naming it."""
    if "MLX_RANK" not in os.environ:  # not started by mlx.launch: a group of one
        return mx.distributed.init()
    seconds = float(os.environ.get("T5_MLX_CONNECT_SECONDS", CONNECT_SECONDS)) if seconds is None else seconds
    message = (f"stage rank {os.environ['MLX_RANK']}: the other ranks did not answer in {seconds:g} s (a host down or "
               "unreachable, or a rank not started: mlx.launch starts them all)")
    watchdog = subprocess.Popen([sys.executable, "-c", WATCHDOG, str(os.getpid()), str(seconds), message],
                                stdin=subprocess.PIPE)
    try:
        return mx.distributed.init()
    except RuntimeError as e:  # a hostfile MLX cannot read, an address not this machine's
        raise StageError(f"stage rank {os.environ['MLX_RANK']}: {' '.join(str(e).split())}") from None
    finally:
        watchdog.stdin.close()
        watchdog.wait()


def local_ranks(count: int, argv, folder, env: dict | None = None, started: int | None = None) -> list:
    """`count` ranks on this machine over the ring backend, as `mlx.launch --hosts 127.0.0.1 -n COUNT` starts them
    (whose relay of their output keeps a core busy: the tests and `bench stages` start them so instead), each running
    `python ARGV` (or argv[rank], one list per rank) in this repository, with its output on pipes; the hostfile is
    written in `folder`. Only the first `started` are started (the others: a host that never answers)."""
    import json
    import socket

    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    hosts = [[f"127.0.0.1:{s.getsockname()[1]}"] for s in sockets]
    for s in sockets:
        s.close()
    hostfile = folder / f"hosts-{os.getpid()}-{hosts[0][0].split(':')[1]}.json"
    hostfile.write_text(json.dumps(hosts))
    return [subprocess.Popen([sys.executable, *map(str, argv[rank] if isinstance(argv[0], list) else argv)],
                             env=os.environ | {"MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)} | (env or {}),
                             cwd=os.path.dirname(os.path.abspath(__file__)), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
            for rank in range(count if started is None else started)]


def rank() -> int:
    """This process's rank among those mlx.launch started (0 without it)."""
    return connected().rank()


def count(stages) -> int:
    """How many stages `stages` asks for: a count, each stage's layers, or None (one)."""
    return len(stages) if isinstance(stages, (list, tuple)) else int(stages or 1)


def join(folder, stages) -> Link:
    """This process's link to the others `mlx.launch` started, checked: as many ranks as `stages` asks (a count, or
    each stage's layer counts), every rank on the same converted folder (its config's hash) and the same stages."""
    link = Link(connected())
    wanted = count(stages)
    if link.size != wanted:
        raise LoadError(f"{wanted} stages need {wanted} ranks; this run has {link.size} "
                        f"(start it with: mlx.launch -n {wanted} ... or --hosts of {wanted} machines)")
    for what, mine in (("another model", (folder / "config.json").read_bytes()), ("other stages", repr(stages).encode())):
        digest = list(hashlib.sha256(mine).digest())
        every = link.checked(None, lambda: mx.eval(x := mx.distributed.all_gather(mx.array([digest], mx.uint8),
                                                                                  group=link.group)) or x)
        for other, theirs in enumerate(every.tolist()):
            if theirs != digest:
                raise LoadError(f"stage rank {other} has {what} than rank {link.rank} ({folder}, stages {stages}): "
                                "every rank must load the same converted folder, split the same way")
    return link


def layer_bytes(weights: dict, stack: str, count: int) -> list[int]:
    return [sum(a.nbytes for name, a in weights.items() if name.startswith(f"{stack}.layers.{i}.")) for i in range(count)]


def even(sizes: list[int], ranks: int, least: int) -> list[int]:
    """Where each of `ranks` contiguous runs of layers ends, each of at least `least` layers, the heaviest run
    (in bytes) as light as it can be."""
    total = [0]
    for size in sizes:
        total.append(total[-1] + size)
    best = {(0, i): (total[i], [i]) for i in range(least, len(sizes) + 1)}  # (heaviest, ends) of r + 1 runs over i layers
    for r in range(1, ranks):
        for i in range((r + 1) * least, len(sizes) + 1):
            best[r, i] = min((max(best[r - 1, j][0], total[i] - total[j]), best[r - 1, j][1] + [i])
                             for j in range(r * least, i - least + 1))
    return best[ranks - 1, len(sizes)][1]


def split(encoder_sizes: list[int], decoder_sizes: list[int], ranks: int, given=None) -> list[tuple[range, range]]:
    """Each stage's encoder layers and decoder layers: both stacks cut into `ranks` contiguous runs as even in
    bytes as they go (every stage with a decoder layer; with encoder layers, where there are as many as stages),
    or as `given`: each stage's (encoder layers, decoder layers) counts."""
    E, D = len(encoder_sizes), len(decoder_sizes)
    if given is not None:
        counts = [tuple(stage) for stage in given]
        if sum(e for e, _ in counts) != E or sum(d for _, d in counts) != D or any(e < 0 or d < 1 for e, d in counts):
            raise LoadError(f"stages of {','.join(f'{e}:{d}' for e, d in counts)} (encoder:decoder layers) do not split "
                            f"this model's {E} encoder and {D} decoder layers, each stage with a decoder layer")
        encoder_ends = [sum(e for e, _ in counts[: i + 1]) for i in range(ranks)]
        decoder_ends = [sum(d for _, d in counts[: i + 1]) for i in range(ranks)]
    else:
        if D < ranks:
            raise LoadError(f"{ranks} stages need {ranks} decoder layers; this model has {D}")
        encoder_ends = even(encoder_sizes, ranks, 1 if E >= ranks else 0)
        decoder_ends = even(decoder_sizes, ranks, 1)
    return [(range(e0, e1), range(d0, d1)) for e0, e1, d0, d1 in
            zip([0] + encoder_ends[:-1], encoder_ends, [0] + decoder_ends[:-1], decoder_ends)]


def place(model: EncoderDecoder, weights: dict, link: Link, given=None) -> dict:
    """Cut `model` to this rank's layers, and `weights` to theirs (renumbered); the other ranks' are never read."""
    args = model.args
    link.parts = split(layer_bytes(weights, "encoder", args.num_layers),
                       layer_bytes(weights, "decoder", args.num_decoder_layers), link.size, given)
    own_encoder, own_decoder = link.parts[link.rank]
    model.encoder.layers = [model.encoder.layers[i] for i in own_encoder]
    model.decoder.layers = [model.decoder.layers[i] for i in own_decoder]
    last_encoder = max(rank for rank, (encoder, _) in enumerate(link.parts) if len(encoder))
    model.encoder.starts, model.encoder.ends = link.rank == 0, link.rank == last_encoder
    model.decoder.starts, model.decoder.ends = link.rank == 0, link.rank == link.size - 1
    # What one stage alone uses: the input layers (rank 0's), each stack's final norm (the stage that ends it), the
    # head (the last stage's; a tied head is the embedding, which the last stage then keeps too).
    unused = [] if model.decoder.ends else ["lm_head", "final_logits_bias"]
    if link.rank > 0 and not (model.decoder.ends and args.tie_word_embeddings):
        unused.append("shared")
    for stack in ("encoder", "decoder"):
        module = model[stack]
        unused += [f"{stack}.{name}" for name in ("positions", "embedding_norm") if not module.starts and name in module]
        unused += [f"{stack}.final_norm"] if not module.ends and "final_norm" in module else []
    unused += ["stem"] if link.rank > 0 and "stem" in model else []
    for name in unused:
        *parent, leaf = name.split(".")
        owner = model[parent[0]] if parent else model
        if leaf in owner:
            del owner[leaf]
    owned = {"encoder": own_encoder, "decoder": own_decoder}
    kept = {}
    for name, array in weights.items():
        parts = name.split(".")
        if parts[0] in owned and parts[1] == "layers":
            layers = owned[parts[0]]
            if int(parts[2]) not in layers:
                continue
            name = ".".join([parts[0], "layers", str(int(parts[2]) - layers.start), *parts[3:]])
        elif any(name == gone or name.startswith(gone + ".") for gone in unused):
            continue
        kept[name] = array
    return kept


def with_mask(x: mx.array, mask: mx.array | None) -> tuple:
    """A command's payloads: hidden states, and the padding mask if there is one (a mask of ones would change the
    attention's kernel, and so its rounding, from the one process's)."""
    return (x,) if mask is None else (x, mask.astype(mx.int32))


class Pipeline(EncoderDecoder):
    """Rank 0's target: its own stage, and the others' through the link. Encoding, caches and decode steps are
    EncoderDecoder's, carried down the stages."""

    link: Link

    def encoding(self, source: mx.array, mask: mx.array | None = None, lanes: tuple | None = None):
        x = yield from super().encoding(source, mask, lanes)
        if self.encoder.ends:
            return x
        self.link.command(Command(ENCODE, sizes=x.shape, dtype=x.dtype, masked=mask is not None), *with_mask(x, mask))
        return self.link.receive(self.link.size - 1, x.shape, x.dtype)

    def make_cache(self, encoder_output: mx.array, mask: mx.array | None = None, lanes: tuple | None = None):
        own = super().make_cache(encoder_output, mask, lanes)
        self.link.caches += 1
        cache = StagedCache(self.link, self.link.caches, own.cross_keys_values, own.cross_bias)
        self.link.command(Command(CACHE, cache.id, encoder_output.shape, dtype=encoder_output.dtype,
                                  masked=mask is not None), *with_mask(encoder_output, mask))
        return cache

    def decode(self, tokens: mx.array, cache: "StagedCache") -> mx.array:
        hidden = super().decode(tokens, cache)
        self.link.command(Command(DECODE, cache.id, hidden.shape, dtype=hidden.dtype), hidden)
        B, L, _ = hidden.shape
        return self.link.receive(self.link.size - 1, (B, L, self.args.vocab_size), hidden.dtype)

    def cross_attention_weights(self, tokens: mx.array, cache: "StagedCache", layers: set[int]) -> dict:
        """As EncoderDecoder's, each stage capturing its own layers' (the decoder's layers counted over all stages),
        which come back to rank 0 stage by stage."""
        own = range(len(self.decoder.layers))
        hidden, found = self.capturing_pass(tokens, cache, {layer for layer in layers if layer in own})
        wanted = tuple(sorted(layers))
        self.link.command(Command(WEIGHTS, cache.id, hidden.shape, wanted, hidden.dtype), hidden)
        theirs = [layer for layer in wanted if layer not in own]
        if theirs:  # (gathered down the stages, from the last)
            B, L, _ = hidden.shape
            S, H = cache.cross_keys_values[0][0].shape[2], self.args.num_heads
            found |= dict(zip(theirs, self.link.receive(self.link.size - 1, (len(theirs), B, H, L, S), mx.float32)))
        return found

    def memory(self) -> list[dict]:
        """Each stage's memory, rank by rank, in bytes: its weights, what MLX holds now and the most it has held."""
        self.link.command(Command(MEMORY, ints=own_memory(self)))
        every = self.link.receive(self.link.size - 1, (3 * self.link.size,)).tolist()
        return [dict(zip(("weights", "active", "peak"), (kib * 1024 for kib in every[i : i + 3])))
                for i in range(0, len(every), 3)]

    @property
    def cache_bytes_per_token(self) -> int:
        """What the stage holding the most decoder layers keeps of each token (the server's budget bounds each
        stage's caches by it)."""
        return max(len(decoder) for _, decoder in self.link.parts) * self.cache_bytes_per_layer


class StagedCache(DecoderCache):
    """Rank 0's cache of its own layers; each change to it is made to the other stages' caches of the same id."""

    def __init__(self, link: Link, id: int, cross_keys_values: list, cross_bias):
        super().__init__(cross_keys_values, cross_bias)
        self.link, self.id = link, id

    def trim(self, n: int | list[int]) -> None:
        super().trim(n)
        self.link.command(Command(TRIM, self.id, ints=tuple(n) if isinstance(n, list) else (n,) * len(self.offsets)))

    def keep(self, rows: list[int], cross_length: int | None = None) -> None:
        super().keep(rows, cross_length)
        self.link.command(Command(KEEP, self.id, (-1 if cross_length is None else cross_length, 0, 0), tuple(rows)))

    def row(self, row: int) -> "StagedCache":
        one = super().row(row)
        self.link.caches += 1
        cache = StagedCache(self.link, self.link.caches, one.cross_keys_values, one.cross_bias)
        self.link.command(Command(ROW, self.id, (cache.id, row, 0)))
        return cache

    def reorder(self, rows: list[int]) -> None:
        super().reorder(rows)
        self.link.command(Command(REORDER, self.id, ints=tuple(rows)))

    def extend(self, other: "StagedCache") -> None:
        super().extend(other)
        self.link.command(Command(EXTEND, self.id, (other.id, 0, 0)))
        other.id = None

    def __del__(self):
        if getattr(self, "id", None) is not None:
            self.link.dropped.append(self.id)


def own_memory(model: EncoderDecoder) -> tuple[int, ...]:
    """This stage's weights, active and peak memory, in KiB (int32 holds 2 TiB of them)."""
    weights = sum(array.nbytes for _, array in tree_flatten(model.parameters()))
    return weights // 1024, mx.get_active_memory() // 1024, mx.get_peak_memory() // 1024


def cross_weights_stage(model: EncoderDecoder, link: Link, command: Command, hidden: mx.array, cache) -> None:
    """A stage's part of Pipeline.cross_attention_weights: its layers' pass over the hidden states, for the next
    stage, and the wanted layers' weights among them added to those of the stages before (received here); the last
    stage sends them all to rank 0."""
    before = [layer for layer in command.ints if link.parts[0][1].stop <= layer < link.parts[link.rank][1].start]
    B, L, _ = hidden.shape
    S, H = cache.cross_keys_values[0][0].shape[2], model.args.num_heads
    gathered = [link.receive(link.rank - 1, (len(before), B, H, L, S), mx.float32)] if before else []
    start = link.parts[link.rank][1].start
    own = [layer for layer in command.ints if layer - start in range(len(model.decoder.layers))]
    out, captured = model.capturing_pass(hidden, cache, {layer - start for layer in own})
    gathered += [mx.stack([captured[layer - start].astype(mx.float32) for layer in own])] if own else []
    weights = mx.concatenate(gathered) if gathered else None
    if link.rank == link.size - 1:
        if weights is not None:
            link.reply(weights)
    else:
        link.pass_on(command, out, *([] if weights is None else [weights]))


def work(model: EncoderDecoder, link: Link) -> None:
    """A stage other than rank 0: apply rank 0's commands to this rank's layers and caches, in order, until it
    exits; what the last stage makes (the encoder's output, the logits, every stage's memory) goes back to rank 0."""
    caches, last = {}, link.rank == link.size - 1
    while True:
        command, payloads = link.next_command()
        op, cache = command.op, caches.get(command.cache)
        if op == ENCODE:  # (the stages past the encoder's last pass its output on as it is)
            out = drained(model.encoder.pieces(payloads[0], payloads[1] if command.masked else None, cpu.lanes()))
            link.reply(out) if last else link.pass_on(command, out, *payloads[1:])
            continue
        if op == DECODE:
            out = model.decode(payloads[0], cache)
            link.reply(out) if last else link.pass_on(command, out)
            continue
        if op == WEIGHTS:  # a pass over one row's tokens, the wanted layers' weights gathered down the stages
            cross_weights_stage(model, link, command, payloads[0], cache)
            continue
        if op == MEMORY:  # each stage's figures, added in turn
            command = replace(command, ints=command.ints + own_memory(model))
            if last:
                link.reply(mx.array(command.ints, mx.int32))
                continue
        elif op == ROW:
            caches[command.sizes[0]] = cache.row(command.sizes[1])
        elif op == CACHE:
            caches[command.cache] = model.make_cache(payloads[0], payloads[1] if command.masked else None)
        elif op == TRIM:
            cache.trim(list(command.ints))
        elif op == KEEP:
            cache.keep(list(command.ints), None if command.sizes[0] < 0 else command.sizes[0])
        elif op == REORDER:
            cache.reorder(list(command.ints))
        elif op == EXTEND:
            cache.extend(caches.pop(command.sizes[0]))
        elif op == DROP:
            for dropped in command.ints:
                caches.pop(dropped, None)
        link.pass_on(command, *payloads)
        if op == EXIT:
            return


def serve_or_exit(model: EncoderDecoder | None, link: Link) -> None:
    """On rank 0, send EXIT down the stages when the program ends (registered as soon as the ranks have joined:
    a rank 0 that fails to load still ends the others); on the others, work until then and end the process (what a
    launched rank is for), with one line on stderr if a stage fails."""
    if link.rank == 0:
        atexit.register(link.close)
        return
    try:
        work(model, link)
    except StageError as e:  # one line naming the rank: nothing hangs, no traceback per rank
        print(e, file=sys.stderr, flush=True)
        sys.exit(1)
    except Exception as e:
        print(f"stage rank {link.rank}: {' '.join(str(e).split()) or type(e).__name__}", file=sys.stderr, flush=True)
        sys.exit(1)
    sys.exit(0)
