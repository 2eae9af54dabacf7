"""Records vLLM's KV-event wire conversation for kvengine's fixtures.

Run with a Python that has vLLM 0.32.0 installed:
    python record.py > kv_events_replay.json

It starts vLLM's own `ZmqEventPublisher` (PUB on tcp://*:PORT, ROUTER replay socket on
tcp://127.0.0.1:PORT2, topic "kv-events"), publishes four batches, and captures with pyzmq
exactly what a SUB socket receives live and what a DEALER receives for replay requests
from seq 0, 2 and 9. Frames are written as hex.
"""

import json
import socket
import sys
import time

import zmq
from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

BS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def store(p: int, blocks: int) -> BlockStored:
    # Engine hashes p * 1000 + i, tokens p * 100_000 + t (as transport/tests/zmq_ingest.rs).
    return BlockStored(
        block_hashes=[p * 1000 + i for i in range(blocks)],
        parent_block_hash=None,
        token_ids=[p * 100_000 + t for t in range(blocks * BS)],
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def main() -> None:
    pub_port, replay_port = free_port(), free_port()
    publisher = ZmqEventPublisher(
        0,
        endpoint=f"tcp://*:{pub_port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        topic="kv-events",
    )
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    time.sleep(1.0)  # PUB/SUB slow joiner

    batches = [
        [store(1, 2)],
        [store(2, 2)],
        [BlockRemoved(block_hashes=[2001], medium="GPU")],
        [store(3, 1)],
    ]
    for i, events in enumerate(batches):
        publisher.publish(KVEventBatch(ts=1_700_000_000.0 + i, events=events))

    live = []
    while len(live) < len(batches):
        if not sub.poll(10_000):
            sys.exit("no live batch within 10 s")
        live.append([f.hex() for f in sub.recv_multipart()])

    replays = []
    for start in (0, 2, 9):
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        request = [b"", start.to_bytes(8, "big")]
        dealer.send_multipart(request)
        replies = []
        while True:
            if not dealer.poll(10_000):
                sys.exit(f"no replay reply for start {start}")
            frames = dealer.recv_multipart()
            replies.append([f.hex() for f in frames])
            if len(frames) >= 2 and frames[-2] == b"\xff" * 8:
                break
        dealer.close(linger=0)
        replays.append(
            {"request": [f.hex() for f in request], "start": start, "replies": replies}
        )

    publisher.shutdown()
    sub.close(linger=0)
    import vllm

    json.dump(
        {
            "recorded_with": f"vllm {vllm.__version__}, ZmqEventPublisher",
            "topic": "kv-events",
            "block_size": BS,
            "live": live,
            "replays": replays,
        },
        sys.stdout,
        indent=1,
    )
    print()


if __name__ == "__main__":
    main()
