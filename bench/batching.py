"""Many prompts at once: `batch` (batched decoding by batch size, against transformers' batched generate)
and `serve` (server.py under concurrent clients, against the same prompts offline)."""

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from bench import fixtures
from bench.fixtures import DEMO
from bench.harness import decode, percentile, ratio, table
from bench.references import HFWorker


# ---------------------------------------------------------------- batch


def run_batch(args) -> dict:
    """Throughput over many prompts, by batch size: our batched speculative
    decoding at each num-draft, our batched regular decoding, and
    transformers' batched generate (its assisted mode takes no batches), with
    both models' encoding alone as the floor under a run. Batch size 1 is
    prompt-by-prompt decoding. Runs alternate within a pass; medians over passes."""
    from rows import encode_for
    from loading import Models, load_model, load_tokenizer
    from options import Settings

    bench_pair = fixtures.benchmark_pair(args.dir)
    pairs = {"demo pair": (DEMO / "target", DEMO / "draft", bench_pair["draft_hf"]),
             "benchmark pair": (bench_pair["target"], bench_pair["draft"], bench_pair["target_hf"])}
    tokenizer = load_tokenizer(DEMO / "target")
    demo = fixtures.held_out_prompts()
    prompts = [tokenizer.encode(demo[i % len(demo)]) for i in range(args.prompts or 32)]
    sizes = [int(size) for size in args.batch_sizes.split(",")]
    num_drafts = [int(k) for k in (args.num_drafts or "1,2,3,4").split(",")]
    data = {"prompts": len(prompts), "max_tokens": args.tokens, "repeats": args.repeats, "sizes": sizes, "pairs": {}}
    for name, (target_dir, draft_dir, hf_dir) in pairs.items():
        if args.pairs and name.split()[0] not in args.pairs.split(","):
            continue
        models, worker = Models(load_model(target_dir), load_model(draft_dir)), HFWorker(hf_dir)

        def one_pass(batch: list) -> dict:
            runs = {}
            for size in sizes:
                started = time.perf_counter()
                for first in range(0, len(batch), size):  # both models' encoding: the floor under a run
                    encode_for([models.target, models.draft], batch[first : first + size])
                runs[f"encoding {size}"] = (time.perf_counter() - started, None)
                for k in num_drafts:
                    tokens, _, seconds = decode(models, batch, Settings(max_tokens=args.tokens, num_draft=k), size)
                    runs[f"speculative {k} {size}"] = (seconds, tokens)
                tokens, _, seconds = decode(models, batch, Settings(max_tokens=args.tokens, speculative=False), size)
                runs[f"regular {size}"] = (seconds, tokens)
                result = worker.run_batched(batch, args.tokens, size)
                runs[f"transformers {size}"] = (result["seconds"], result["tokens"])
            return runs

        one_pass(prompts[: max(sizes)])  # warm-up: kernels, allocator pools, every batch shape once
        passes = [one_pass(prompts) for _ in range(args.repeats)]
        worker.close()
        reference = passes[-1][f"regular {sizes[0]}"][1]
        data["pairs"][name] = {
            "generated": sum(map(len, reference)),
            "same_tokens": all(p[key][1] == reference for p in passes for key in p if not key.startswith("encoding")),
            "seconds": {key: statistics.median(p[key][0] for p in passes) for key in passes[0]}}
    data["num_drafts"] = num_drafts
    return data


def render_batch(data: dict) -> str:
    text = (f"{data['prompts']} prompts (the held-out demo prompts, again from the first), at most {data['max_tokens']} "
            f"tokens each, greedy, delta 0; tokens a second over all prompts, encoding included; medians of "
            f"{data['repeats']} passes, runs alternating within a pass. Ceiling: transformers' run over our encoding "
            f"alone, the ratio speculative decoding would reach if decoding took no time.")
    for name, pair in data["pairs"].items():
        seconds = pair["seconds"]
        rate = {key: pair["generated"] / value for key, value in seconds.items()}
        best = {size: max(data["num_drafts"], key=lambda k: rate[f"speculative {k} {size}"]) for size in data["sizes"]}
        unbatched = rate.get(f"speculative {best.get(1)} 1")
        rows = []
        for size in data["sizes"]:
            spec = rate[f"speculative {best[size]} {size}"]
            rows.append([size, f"{spec:.1f} ({best[size]})", f"{rate[f'regular {size}']:.1f}",
                         f"{rate[f'transformers {size}']:.1f}",
                         ratio(spec, unbatched) if unbatched else "-", ratio(spec, rate[f"transformers {size}"]),
                         f"{seconds[f'encoding {size}'] / seconds[f'speculative {best[size]} {size}']:.0%}",
                         ratio(seconds[f"transformers {size}"], seconds[f"encoding {size}"])])
        text += (f"\n\n{name}: {pair['generated']} tokens; every run's tokens equal regular decoding's: "
                 f"{'yes' if pair['same_tokens'] else 'NO'}\n\n"
                 + table(["batch size", "speculative (best num-draft)", "regular", "transformers", "over unbatched speculative",
                          "speculative over transformers", "encoding's share", "ceiling"], rows))
    return text


# ---------------------------------------------------------------- serve


def stream_request(client, url: str, body: dict) -> dict:
    """One streamed completion: its time to the first text, its latency and its tokens."""
    started = time.perf_counter()
    first, tokens = None, 0
    with client.stream("POST", url + "/v1/completions",
                       json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            if first is None and any(choice["text"] for choice in data["choices"]):
                first = time.perf_counter() - started
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
    return {"first": first if first is not None else time.perf_counter() - started,
            "latency": time.perf_counter() - started, "tokens": tokens}


def run_clients(url: str, prompts: list[str], clients: int, body: dict) -> dict:
    """`clients` threads each sending the next prompt as soon as their last answer is in."""
    import httpx

    queue, results = list(reversed(prompts)), []

    def client_loop():
        with httpx.Client(timeout=600) as client:
            while queue:
                try:
                    prompt = queue.pop()
                except IndexError:
                    return
                results.append(stream_request(client, url, {**body, "prompt": prompt}))

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client_loop) for _ in range(clients)]:
            future.result()
    seconds = time.perf_counter() - started
    return {"tokens_per_second": sum(r["tokens"] for r in results) / seconds,
            "first": [r["first"] for r in results], "latency": [r["latency"] for r in results]}


def short_among_long(server, prompts: list[str], repeats: int, num_draft: int) -> tuple[float, float]:
    """A 5-token request's latency alone, and sent while 8 requests of 500
    tokens (decoding past their end of text) run: medians."""
    import httpx

    short = {"model": "default", "prompt": prompts[0], "max_tokens": 5, "ignore_eos": True, "delta": 0, "num_draft": num_draft}
    long = {**short, "max_tokens": 500}
    url = server.url
    with httpx.Client(timeout=600) as client:
        alone = [stream_request(client, url, short)["latency"] for _ in range(repeats + 1)][1:]
        together = []
        for _ in range(repeats):
            with ThreadPoolExecutor(8) as pool:
                running = [pool.submit(stream_request, httpx.Client(timeout=600), url, {**long, "prompt": p})
                           for p in prompts[1:9]]
                deadline = time.time() + 60
                while server.metrics()["vllm:num_requests_running"] < 8 and time.time() < deadline:
                    time.sleep(0.01)
                together.append(stream_request(client, url, short)["latency"])
                for future in running:
                    future.result()
    return statistics.median(alone), statistics.median(together)


def run_serve(args) -> dict:
    """server.py under 1, 4, 16 and 64 concurrent clients (each sending its
    next request when its last answer is in), against the same prompts
    through batch_generate offline at the same batch size; and a short
    request sent while long ones run, against the same request alone."""
    from generate import measure_batch
    from loading import load
    from options import Settings
    from serving.process import ServerProcess

    bench_pair = fixtures.benchmark_pair(args.dir)
    pairs = {"demo pair": (DEMO / "target", DEMO / "draft"), "benchmark pair": (bench_pair["target"], bench_pair["draft"])}
    demo = fixtures.held_out_prompts()
    counts = [int(n) for n in (args.clients or "1,4,16,64").split(",")]
    body = {"model": "default", "max_tokens": args.tokens, "num_draft": args.num_draft, "delta": 0}
    data = {"max_tokens": args.tokens, "num_draft": args.num_draft, "repeats": args.repeats, "pairs": {}}
    for name, (target_dir, draft_dir) in pairs.items():
        if args.pairs and name.split()[0] not in args.pairs.split(","):
            continue
        requests = {n: [demo[i % len(demo)] for i in range(max(32, 4 * n))] for n in counts}
        models = load(target_dir, draft=draft_dir)
        settings = Settings(max_tokens=args.tokens, num_draft=args.num_draft)
        offline = {}
        for n in counts:
            measure_batch(models, requests[n][:n], settings, n)  # warm-up: this batch size's shapes
            runs = [measure_batch(models, requests[n], settings, n) for _ in range(args.repeats)]
            offline[n] = statistics.median(r.generated / r.seconds for r in runs)
        del models
        server = ServerProcess("--model", str(target_dir), "--draft-model", str(draft_dir), "--max-batch", str(max(counts)),
                               "--max-queue", str(4 * max(counts)))
        try:
            rows = {}
            for n in counts:
                run_clients(server.url, requests[n][:n], n, body)  # warm-up
                runs = [run_clients(server.url, requests[n], n, body) for _ in range(args.repeats)]
                first, latency = sum((r["first"] for r in runs), []), sum((r["latency"] for r in runs), [])
                rows[str(n)] = {"tokens_per_second": statistics.median(r["tokens_per_second"] for r in runs),
                                "offline": offline[n], "first": [percentile(first, 0.5), percentile(first, 0.99)],
                                "latency": [percentile(latency, 0.5), percentile(latency, 0.99)]}
            short, long = short_among_long(server, demo, args.repeats, args.num_draft)
        finally:
            server.stop()
        data["pairs"][name] = {"clients": rows, "short_alone": short, "short_among_long": long}
    return data


def render_serve(data: dict) -> str:
    text = (f"Greedy, delta 0, num-draft {data['num_draft']}, at most {data['max_tokens']} tokens, the held-out demo "
            f"prompts (4 requests a client, 32 at least), clients and server on the same cores; offline: the same "
            f"prompts through batch_generate at a batch size of the client count. Medians of {data['repeats']} runs.")
    for name, pair in data["pairs"].items():
        one = pair["clients"][min(pair["clients"], key=int)]["tokens_per_second"]
        rows = [[n, f"{row['tokens_per_second']:.1f}", f"{row['offline']:.1f}",
                 f"{row['tokens_per_second'] / row['offline']:.0%}",
                 ratio(row["tokens_per_second"], one), f"{row['first'][0] * 1e3:.0f} / {row['first'][1] * 1e3:.0f} ms",
                 f"{row['latency'][0] * 1e3:.0f} / {row['latency'][1] * 1e3:.0f} ms"] for n, row in pair["clients"].items()]
        text += (f"\n\n{name}\n\n" + table(["clients", "server tokens/s", "offline", "server / offline", "server / one client",
                                              "first token p50 / p99", "latency p50 / p99"], rows)
                 + f"\n\nA 5-token request alone: {pair['short_alone'] * 1e3:.0f} ms; sent while 8 requests of 500 tokens "
                 f"run: {pair['short_among_long'] * 1e3:.0f} ms ({ratio(pair['short_among_long'], pair['short_alone'])}).")
    return text
