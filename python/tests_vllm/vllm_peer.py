"""One side of the real-vLLM test, run by the Python of .venv-vllm (vLLM
0.33.0 and the ecxfer wheel installed): vLLM's own plugin loader, shared
region, embedding cache, ZMQ control plane and producer/consumer session
code, with ecxfer as the data transport.

    python vllm_peer.py producer ENGINE_ID PORT NUM_BLOCKS BLOCK_SIZE MM_HASH N_BLOCKS
    python vllm_peer.py consumer ENGINE_ID PORT NUM_BLOCKS BLOCK_SIZE MM_HASH N_BLOCKS

Protocol lines on stdout start with "@@ "; the parent answers on stdin.
"""

import json
import os
import sys
import time


def say(**msg):
    sys.stdout.write("@@ " + json.dumps(msg) + "\n")
    sys.stdout.flush()


def pattern(seed: int, block: int, size: int) -> bytes:
    base = bytes(((block * 131 + seed + 7 * j) & 0xFF) for j in range(256))
    return (base * (size // 256 + 1))[:size]


def main():
    role, engine_id, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    nb, bs, mm_hash, n = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6], int(sys.argv[7])

    # vLLM's own plugin loader, as at engine start (VLLM_PLUGINS=ecxfer).
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    # The class ECCPUScheduler._setup_nixl imports, at the same place.
    from vllm.distributed.ec_transfer.ec_connector.cpu.data.base import DataTransport
    from vllm.distributed.ec_transfer.ec_connector.cpu.data.nixl import NixlDataTransport
    from vllm.distributed.ec_transfer.ec_connector.cpu.ec_shared_region import ECSharedRegion
    from vllm.distributed.ec_transfer.ec_connector.cpu.scheduler.embedding_cache import EmbeddingCache
    from vllm.distributed.ec_transfer.ec_connector.cpu.session import ConsumerSession, ProducerSession
    from vllm.distributed.ec_transfer.ec_connector.cpu.control.zmq import ZmqClientTransport, ZmqServerTransport
    from vllm.distributed.ec_transfer.ec_connector.cpu.protocol import compute_ec_compatibility_hash
    from vllm.distributed.nixl_utils import NixlWrapper, nixl_agent_config
    from vllm.version import __version__

    import ecxfer

    cls = NixlDataTransport
    info = {
        "vllm": __version__,
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "is_ecxfer": cls is ecxfer.EcxferDataTransport,
        "subclass_of_vllm": issubclass(cls, DataTransport),
        "nixl_check_passes": NixlWrapper is not None and nixl_agent_config is not None,
    }
    region = ECSharedRegion(engine_id=engine_id, num_blocks=nb, block_size_bytes=bs)
    cache = EmbeddingCache(nb)
    compat = compute_ec_compatibility_hash(vllm_version=__version__, model="ecxfer-test", dtype="bfloat16", block_size_bytes=bs)
    # As _setup_nixl builds it: keywords only, on vLLM's region.
    data = NixlDataTransport(
        agent_name=engine_id,
        base_ptr=region.blocks.data_ptr(),
        num_blocks=region.num_blocks,
        block_size_bytes=region.block_size_bytes,
        total_size_bytes=region.num_blocks * region.block_size_bytes,
    )
    info["instance_is_vllm_datatransport"] = isinstance(data, DataTransport)
    mm = memoryview(region._mmap_obj)

    if role == "producer":
        entry = cache.alloc(mm_hash, n)
        for k, b in enumerate(entry.block_ids):
            mm[b * bs : (b + 1) * bs] = pattern(7, k, bs)  # k-th block of the encoding
        cache.mark_ready(mm_hash)
        session = ProducerSession(
            transport=ZmqServerTransport(host="127.0.0.1", port=port), data=data, cache=cache, compat_hash=compat
        )
        say(ready=True, **info)
        pinned_seen = False
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # one engine step per millisecond
            session.poll_step()
            e = cache.get(mm_hash)
            if e._pin_count > 0:
                pinned_seen = True
            elif pinned_seen and e.evictable:
                break  # the READ's notification unpinned it
            time.sleep(0.001)
        say(pinned_seen=pinned_seen, unpinned=cache.get(mm_hash).evictable, held=cache.has_held_entries())
        sys.stdin.readline()
        session.close()
    else:
        # Count the READs vLLM's session posts through ecxfer's C reader of
        # index lists (it passes list[int]), and what they returned.
        from ecxfer import transport as ecx_transport

        c_reader = []
        real_post = ecx_transport._post_py
        if real_post is not None:

            def counted(*args):
                h = real_post(*args)
                c_reader.append(h)
                return h

            ecx_transport._post_py = counted
        client = ZmqClientTransport()
        addr = ("127.0.0.1", port)
        session = ConsumerSession(addr=addr, zmq_conn=client.connect(addr), transport=client, data=data, compat_hash=compat)
        entry = cache.alloc(mm_hash, n)
        local = list(entry.block_ids)
        session.start_xfer(mm_hash, local, time.monotonic() + 30)
        done, results = False, []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not done:  # the scheduler's step
            msgs = client.poll()
            session.poll(msgs.get(addr, []), time.monotonic())
            r = session.take_results()
            results.append({k: sorted(v) for k, v in vars(r).items() if k != "settled" and v})
            done = mm_hash in r.completed
            if r.tombstoned or r.quarantined:
                break
            time.sleep(0.001)
        bad = [k for k, b in enumerate(local) if bytes(mm[b * bs : (b + 1) * bs]) != pattern(7, k, bs)]
        say(done=done, bad_blocks=bad, results=[x for x in results if x], c_reader=c_reader, **info)
        sys.stdin.readline()
        session.close()
        client.close()
    data.deregister()
    del mm
    region.cleanup()
    os._exit(0)


if __name__ == "__main__":
    main()
