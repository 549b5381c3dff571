"""`serve`: server.py under concurrent clients, against the same prompts through batch_generate offline; a short
request among long ones; and, on the benchmark pair, regular decoding, fixed num-drafts and num-draft auto side by
side at each client count.

The clients share the server's cores, so they must cost it little: each is a coroutine on one kept-alive HTTP/1.1
connection, in one thread, reading the server-sent events as they come (httpx's client took about 7 ms of CPU a
request, a quarter of this 2-core machine at 64 clients; these take a fraction of a millisecond). Their CPU time is
recorded beside the figures.
"""

import asyncio
import json
import random
import statistics
import time
from urllib.parse import urlsplit

from bench import fixtures
from bench.fixtures import DEMO
from bench.harness import percentile, ratio, table

SHORT_TOKENS, LONG_TOKENS, LONG_REQUESTS = 5, 500, 8  # the short request, and the long ones it is sent among


class Connection:
    """One kept-alive HTTP/1.1 connection that streams completions."""

    def __init__(self, url: str):
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port
        self.reader = self.writer = None

    async def completion(self, body: dict, started_text: asyncio.Event | None = None) -> dict:
        """A streamed completion: its time to the first text (`started_text` is set then), its latency and its
        tokens (the usage's)."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        payload = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}).encode()
        started = time.perf_counter()
        self.writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (self.host.encode(), self.port, len(payload), payload))
        status, headers = await self.reader.readline(), {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        if b" 200 " not in status or headers.get("transfer-encoding") != "chunked":
            body = await self.reader.readexactly(int(headers.get("content-length", 0)))
            raise RuntimeError(f"{status.decode().strip()}: {body.decode(errors='replace')}")
        first, tokens, pending = None, 0, b""
        while size := int((await self.reader.readline()).split(b";")[0], 16):  # a chunk; 0 ends the body
            pending += (await self.reader.readexactly(size + 2))[:-2]
            *events, pending = pending.replace(b"\r\n", b"\n").split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: {"):
                    continue
                data = json.loads(event[6:])
                if "error" in data:  # a stream that failed after its headers
                    raise RuntimeError(data["error"]["message"])
                if first is None and any(choice["text"] for choice in data["choices"]):
                    first = time.perf_counter() - started
                    if started_text is not None:
                        started_text.set()
                tokens = (data.get("usage") or {}).get("completion_tokens", tokens)
        await self.reader.readline()  # the end of the last chunk
        latency = time.perf_counter() - started
        return {"first": latency if first is None else first, "latency": latency, "tokens": tokens}

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def client_loop(url: str, queue: list[dict], results: list[dict]) -> None:
    """One client: the next request as soon as its last answer is in, until the queue is empty."""
    connection = Connection(url)
    try:
        while queue:
            results.append(await connection.completion(queue.pop()))
    finally:
        connection.close()


def run_clients(url: str, bodies: list[dict], clients: int) -> dict:
    """`clients` clients sharing the requests: tokens a second over the whole run, each request's first-text time
    and latency, and the CPU seconds the clients took."""
    async def run():
        queue, results = list(reversed(bodies)), []
        await asyncio.gather(*(client_loop(url, queue, results) for _ in range(clients)))
        return results

    started, cpu = time.perf_counter(), time.process_time()
    results = asyncio.run(run())
    seconds = time.perf_counter() - started
    return {"tokens_per_second": sum(r["tokens"] for r in results) / seconds, "seconds": seconds,
            "client_cpu": (time.process_time() - cpu) / seconds,
            "first": [r["first"] for r in results], "latency": [r["latency"] for r in results]}


def short_among_long(url: str, prompts: list[str], repeats: int, body: dict) -> dict[str, float]:
    """A 5-token request's latency (medians): alone; sent 10 ms after 8 requests of 500 tokens (decoding past their
    end of text), while their prompts are encoded; and sent while they decode (each has streamed its first text), at a
    random moment up to 0.2 s later."""
    short = {**body, "prompt": prompts[0], "max_tokens": SHORT_TOKENS, "ignore_eos": True}
    longs = [{**short, "prompt": prompt, "max_tokens": LONG_TOKENS} for prompt in prompts[1:1 + LONG_REQUESTS]]
    moments = random.Random(0)

    async def one(request: dict, started_text: asyncio.Event | None = None) -> float:
        connection = Connection(url)
        try:
            return (await connection.completion(request, started_text))["latency"]
        finally:
            connection.close()

    async def among(decoding: bool) -> float:
        started = [asyncio.Event() for _ in longs]
        running = [asyncio.create_task(one(long, event)) for long, event in zip(longs, started)]
        if decoding:  # (a long request that fails before its first text raises here, rather than never setting it)
            for task, event in zip(running, started):
                await asyncio.wait([task, asyncio.create_task(event.wait())], return_when=asyncio.FIRST_COMPLETED)
                if task.done():
                    task.result()
        await asyncio.sleep(moments.uniform(0, 0.2) if decoding else 0.01)
        latency = await one(short)
        await asyncio.gather(*running)
        return latency

    alone = [asyncio.run(one(short)) for _ in range(repeats + 1)][1:]
    return {"alone": statistics.median(alone),
            "encoding": statistics.median(asyncio.run(among(False)) for _ in range(repeats)),
            "decoding": statistics.median(asyncio.run(among(True)) for _ in range(repeats))}


def under_load(server, requests: dict[int, list[dict]], repeats: int, offline: dict | None = None) -> dict:
    """Each client count's medians (the warm-up run at its count aside)."""
    rows = {}
    for n, bodies in requests.items():
        run_clients(server.url, bodies[:n], n)  # warm-up: this batch size's shapes
        runs = [run_clients(server.url, bodies, n) for _ in range(repeats)]
        first, latency = sum((r["first"] for r in runs), []), sum((r["latency"] for r in runs), [])
        rows[str(n)] = {"tokens_per_second": statistics.median(r["tokens_per_second"] for r in runs),
                        "client_cpu": statistics.median(r["client_cpu"] for r in runs),
                        "first": [percentile(first, 0.5), percentile(first, 0.99)],
                        "latency": [percentile(latency, 0.5), percentile(latency, 0.99)]}
        if offline is not None:
            rows[str(n)]["offline"] = offline[n]
    return rows


def offline_rates(target_dir, draft_dir, prompts: dict[int, list[str]], settings, repeats: int) -> dict[int, float]:
    """batch_generate's tokens a second on each count's prompts, at a batch size of the count: medians."""
    from generate import measure_batch
    from loading import load

    models, rates = load(target_dir, draft=draft_dir), {}
    for n, texts in prompts.items():
        measure_batch(models, texts[:n], settings, n)  # warm-up
        runs = [measure_batch(models, texts, settings, n) for _ in range(repeats)]
        rates[n] = statistics.median(r.generated / r.seconds for r in runs)
    return rates


def run_serve(args) -> dict:
    """Both pairs at the --num-draft given, server against offline; then the benchmark pair's drafting modes."""
    from options import Settings
    from serving.process import ServerProcess

    bench_pair = fixtures.benchmark_pair(args.dir)
    pairs = {"demo pair": (DEMO / "target", DEMO / "draft"), "benchmark pair": (bench_pair["target"], bench_pair["draft"])}
    demo = fixtures.held_out_prompts()
    counts = [int(n) for n in (args.clients or "1,4,16,64").split(",")]
    prompts = {n: [demo[i % len(demo)] for i in range(max(32, 4 * n))] for n in counts}
    body = {"model": "default", "max_tokens": args.tokens, "delta": 0}

    def requests(**fields):
        return {n: [{**body, **fields, "prompt": prompt} for prompt in texts] for n, texts in prompts.items()}

    def serving(target_dir, draft_dir=None):
        return ServerProcess("--model", str(target_dir), *(["--draft-model", str(draft_dir)] if draft_dir else []),
                             "--max-batch", str(max(counts)), "--max-queue", str(4 * max(counts)))

    data = {"max_tokens": args.tokens, "num_draft": args.num_draft, "repeats": args.repeats, "pairs": {}}
    for name, (target_dir, draft_dir) in pairs.items():
        if args.pairs and name.split()[0] not in args.pairs.split(","):
            continue
        offline = offline_rates(target_dir, draft_dir, prompts, Settings(max_tokens=args.tokens, num_draft=args.num_draft),
                                args.repeats)
        server = serving(target_dir, draft_dir)
        try:
            rows = under_load(server, requests(num_draft=args.num_draft), args.repeats, offline)
            short = short_among_long(server.url, demo, args.repeats, {**body, "num_draft": args.num_draft})
            if name == "benchmark pair":
                modes = {str(k): under_load(server, requests(num_draft=k), args.repeats)
                         for k in map(int, (args.num_drafts or "2,3,4").split(","))}
                modes["auto"] = under_load(server, requests(num_draft="auto"), args.repeats)
        finally:
            server.stop()
        data["pairs"][name] = {"clients": rows, "short": short}
        if name == "benchmark pair":
            server = serving(target_dir)
            try:
                modes = {"regular": under_load(server, requests(), args.repeats)} | modes
            finally:
                server.stop()
            data["drafting"] = {mode: {n: row["tokens_per_second"] for n, row in rows.items()} for mode, rows in modes.items()}
    return data


def render_serve(data: dict) -> str:
    text = (f"Greedy, delta 0, num-draft {data['num_draft']}, at most {data['max_tokens']} tokens, the held-out demo "
            f"prompts (4 requests a client, 32 at least); the clients are coroutines in one process on the server's "
            f"cores (their CPU is the last column, in cores); offline: the same prompts through batch_generate at a "
            f"batch size of the client count. Medians of {data['repeats']} runs.")
    for name, pair in data["pairs"].items():
        short = pair["short"]
        one = pair["clients"][min(pair["clients"], key=int)]["tokens_per_second"]
        rows = [[n, f"{row['tokens_per_second']:.1f}", f"{row['offline']:.1f}",
                 f"{row['tokens_per_second'] / row['offline']:.0%}",
                 ratio(row["tokens_per_second"], one), f"{row['first'][0] * 1e3:.0f} / {row['first'][1] * 1e3:.0f} ms",
                 f"{row['latency'][0] * 1e3:.0f} / {row['latency'][1] * 1e3:.0f} ms", f"{row['client_cpu']:.2f}"]
                for n, row in pair["clients"].items()]
        text += (f"\n\n{name}\n\n" + table(["clients", "server tokens/s", "offline", "server / offline", "server / one client",
                                              "first token p50 / p99", "latency p50 / p99", "clients' CPU"], rows)
                 + f"\n\nA {SHORT_TOKENS}-token request alone: {short['alone'] * 1e3:.0f} ms; sent as {LONG_REQUESTS} "
                 f"requests of {LONG_TOKENS} tokens are encoded: {short['encoding'] * 1e3:.0f} ms "
                 f"({ratio(short['encoding'], short['alone'])}); sent while they decode: {short['decoding'] * 1e3:.0f} ms "
                 f"({ratio(short['decoding'], short['alone'])}).")
    if "drafting" in data:
        modes = data["drafting"]
        fixed = [mode for mode in modes if mode not in ("regular", "auto")]
        rows = []
        for n in modes["auto"]:
            best = max(["regular", *fixed], key=lambda mode: modes[mode][n])
            rows.append([n, *(f"{modes[mode][n]:.1f}" for mode in modes),
                         f"{ratio(modes['auto'][n], modes[best][n])} ({best})"])
        text += ("\n\nbenchmark pair, server tokens/s by drafting (the same requests, each mode in turn at each client "
                 "count)\n\n" + table(["clients", "regular", *(f"num-draft {mode}" for mode in fixed), "auto",
                                       "auto / the best other"], rows))
    return text
