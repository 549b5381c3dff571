"""A job's answer on the event loop's side: its pieces as the engine sends them, the client's leaving noticed, and
the streamed response that cancels its jobs however it ends. Both endpoint families (serving/app.py,
serving/transcriptions.py) answer through these."""

import asyncio

from fastapi.responses import StreamingResponse

from serving import shapes
from serving.jobs import Job
from serving.guard import ApiError


async def pieces(job: Job):
    """(text, finish_reason, tokens settled) as the engine sends them, a
    piece a round; the job is cancelled if this ends early."""
    try:
        while True:
            item = await job.out.get()
            if item is None:
                if job.error:
                    raise ApiError(job.status, job.error, "server_error" if job.status >= 500 else "invalid_request_error")
                return
            yield item
    finally:
        job.cancel()


async def cancel_when_gone(jobs: list[Job], receive) -> None:
    """Waits for the client to leave (after its body, the next ASGI message is
    the disconnect), then cancels its jobs: their rows leave at the next round."""
    while (await receive())["type"] != "http.disconnect":
        pass
    for job in jobs:
        job.cancel()


class Events(StreamingResponse):
    """A streamed answer's server-sent events. However the response ends,
    its jobs are cancelled: also when the client left before the first
    event, and Starlette never started the generator whose own `finally`
    would have cancelled them."""

    def __init__(self, events, jobs: list[Job]):
        super().__init__(events, media_type="text/event-stream")
        self.jobs = jobs

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for job in self.jobs:
                job.cancel()


async def interleaved(jobs: list[Job]):
    """(choice index, text, finish reason, tokens settled) from every job as
    each comes; (None, error body, None, None) for a job that failed."""
    if len(jobs) == 1:  # no tasks to interleave
        try:
            async for piece, finish, settled in pieces(jobs[0]):
                yield 0, piece, finish, settled
        except ApiError as e:
            yield None, shapes.error_body(e.message, e.type), None, None
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def drain(index: int, job: Job):
        try:
            async for piece, finish, settled in pieces(job):
                await merged.put((index, piece, finish, settled))
        except ApiError as e:
            await merged.put((None, shapes.error_body(e.message, e.type), None, None))

    tasks = [asyncio.create_task(drain(i, job)) for i, job in enumerate(jobs)]
    finished = asyncio.gather(*tasks)
    try:
        while not (finished.done() and merged.empty()):
            getter = asyncio.ensure_future(merged.get())
            await asyncio.wait({getter, finished}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                yield getter.result()
            else:
                getter.cancel()
    finally:
        for task in tasks:
            task.cancel()
