"""The index alone, as Dynamo's KvIndexer is used: apply a worker's KV events, then ask
which workers hold how much of a prompt.

    python python/examples/indexer_quickstart.py

The batch below is vLLM's msgpack payload (what its ZMQ publisher sends; built here with the
`msgpack` package when installed), or the same events as dicts otherwise. Against real
workers, `indexer.subscribe_zmq(worker_id, "tcp://host:5557", replay="tcp://host:5558")`
follows their publishers instead.
"""

import kvengine

BLOCK = 16


def vllm_batch(token_ids, hashes, parent=None):
    """One BlockStored event in vLLM's msgpack shape, or the dict shape without msgpack."""
    try:
        import msgpack  # type: ignore[import-untyped]
    except ImportError:
        return {"events": [{"type": "stored", "parent_hash": parent, "blocks": [
            {"block_hash": h, "token_ids": token_ids[i * BLOCK:(i + 1) * BLOCK]}
            for i, h in enumerate(hashes)]}]}
    event = ["BlockStored", hashes, parent, token_ids, BLOCK, None, None, None]
    return msgpack.packb([1.0, [event], 0])


def main():
    indexer = kvengine.KvIndexer(block_size=BLOCK)
    prompt = list(range(10_000, 10_000 + 5 * BLOCK + 7))  # 5 full blocks and 7 tokens
    print(indexer.apply_events(1, vllm_batch(prompt[:3 * BLOCK], [11, 12, 13])))
    print(indexer.apply_events(2, vllm_batch(prompt[:5 * BLOCK], [21, 22, 23, 24, 25])))

    matches = indexer.find_matches_for_request(prompt)
    print("find_matches_for_request:", matches)
    assert matches == {1: 3, 2: 5}, matches

    hashes = kvengine.compute_block_hashes(prompt, BLOCK)  # Dynamo's LocalBlockHash values
    assert indexer.find_matches(hashes) == matches
    print("stats:", indexer.stats())


if __name__ == "__main__":
    main()
