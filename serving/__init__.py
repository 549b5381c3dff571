"""The OpenAI-compatible server's parts; server.py starts them.

- `schema.py`: the requests it reads (pydantic), and a chat's one prompt;
- `engine.py`: the thread that owns MLX: jobs, the queue, rounds;
- `shapes.py`: OpenAI's response, chunk, usage and error shapes, as plain functions;
- `app.py`: the HTTP app: its guard (key, body size, shutdown), its routes, completions answered whole or streamed;
- `process.py`: server.py in a process of its own, for the tests and the benchmarks.
"""
