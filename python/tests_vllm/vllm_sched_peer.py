"""One side of the real-vLLM scheduler test, run by the Python of
.venv-vllm (vLLM 0.33.0 and the ecxfer wheel installed): vLLM's own
ECCPUConnector in its scheduler role, built from a VllmConfig-shaped
object, so that vLLM's ECCPUScheduler creates the shared region, runs
_setup_nixl (which builds the data transport the plugin put in place),
announces the encoding in request_finished, admits the consumer's request
in ensure_cache_available, and drives both session ends from its step
(build_connector_meta). No model and no GPU worker: the test writes the
encoding into the producer's region and reports the save and the load as
the worker would (ECCPUWorkerMetadata).

    python vllm_sched_peer.py producer INSTANCE PORT NUM_BLOCKS HIDDEN MM_HASH N_EMBEDS
    python vllm_sched_peer.py consumer INSTANCE PORT NUM_BLOCKS HIDDEN MM_HASH N_EMBEDS

The producer serves on 127.0.0.1:PORT. The consumer reads the producer's
ec_transfer_params as one JSON line on stdin. Protocol lines on stdout
start with "@@ "; a line on stdin ends each side.
"""

import json
import os
import sys
import time
from types import SimpleNamespace

from vllm_peer import pattern, say  # beside this script


def step_until(cond, seconds):
    """Engine steps, one per millisecond, until cond() or the deadline."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.001)
    return cond()


def main():
    role, instance, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    nb, hidden, mm_hash, n = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6], int(sys.argv[7])
    os.environ["VLLM_EC_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    os.environ["VLLM_EC_SIDE_CHANNEL_PORT"] = str(port)

    import torch

    # vLLM's own plugin loader, as at engine start (VLLM_PLUGINS=ecxfer).
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm.config import ECTransferConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.cpu.common import ECCPUWorkerMetadata
    from vllm.distributed.ec_transfer.ec_connector.cpu.connector import ECCPUConnector
    from vllm.distributed.ec_transfer.ec_connector.cpu.data.base import DataTransport
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    import ecxfer

    dtype = torch.bfloat16
    bs = hidden * torch.empty(0, dtype=dtype).element_size()
    ec = ECTransferConfig(
        ec_connector="ECCPUConnector",
        engine_id=f"{instance}-{role}",
        ec_role="ec_producer" if role == "producer" else "ec_consumer",
        ec_connector_extra_config={"ec_cpu_bytes": nb * bs, "ec_enable_nixl": True},
    )
    # What the engine measures at startup on a producer (one dummy encode).
    ec.mm_encoder_output_widths = {"image": hidden}
    config = SimpleNamespace(
        ec_transfer_config=ec,
        instance_id=f"{instance}-{role}",
        use_v2_model_runner=True,
        model_config=SimpleNamespace(dtype=dtype, model="ecxfer-test", get_inputs_embeds_size=lambda: hidden),
        parallel_config=SimpleNamespace(
            data_parallel_index=0,
            tensor_parallel_size=1,
            prefill_context_parallel_size=1,
            distributed_executor_backend="uni",
        ),
    )
    conn = ECCPUConnector(config, ECConnectorRole.SCHEDULER)
    sched = conn.connector_scheduler
    data = sched._data  # what _setup_nixl built
    info = {
        "class": f"{type(data).__module__}.{type(data).__qualname__}",
        "is_ecxfer": isinstance(data, ecxfer.EcxferDataTransport),
        "instance_is_vllm_datatransport": isinstance(data, DataTransport),
    }
    region = sched._region
    mm = memoryview(region._mmap_obj)
    feature = MultiModalFeatureSpec(
        data=None, modality="image", identifier=mm_hash, mm_position=PlaceholderRange(offset=0, length=n)
    )

    if role == "producer":
        request = SimpleNamespace(request_id="req-enc", mm_features=[feature], ec_transfer_params=None)
        conn.update_state_after_alloc(request, 0)
        meta = conn.build_connector_meta(None)
        blocks = meta.saves[mm_hash]
        # The worker's save: the encoding lands in the region's blocks.
        for k, b in enumerate(blocks):
            mm[b * bs : (b + 1) * bs] = pattern(7, k, bs)
        conn.update_connector_output(
            SimpleNamespace(ec_connector_worker_meta=ECCPUWorkerMetadata(completed_saves=[mm_hash]))
        )
        _, params = conn.request_finished(request)
        say(ready=True, params=params, blocks=len(blocks), **info)
        seen = {"pinned": False}

        def unpinned():
            conn.build_connector_meta(None)  # the engine step serves the session
            e = sched._cache.get(mm_hash)
            if e._pin_count > 0:
                seen["pinned"] = True
            return seen["pinned"] and e.evictable

        step_until(unpinned, 60)
        e = sched._cache.get(mm_hash)
        say(pinned_seen=seen["pinned"], unpinned=e.evictable, held=sched._cache.has_held_entries())
    else:
        params = json.loads(sys.stdin.readline())
        request = SimpleNamespace(request_id="req-pre", mm_features=[feature], ec_transfer_params=params)
        failed = set()

        def admitted():
            ok = conn.ensure_cache_available(request, 0)
            conn.build_connector_meta(None)
            failed.update(conn.take_unavailable_requests())
            return ok or bool(failed)

        step_until(admitted, 60)
        ready = conn.has_cache_item(mm_hash)
        # Scheduled: the scheduler hands the encoding to the worker's load.
        conn.update_state_after_alloc(request, 0)
        meta = conn.build_connector_meta(None)
        load = meta.loads.get(mm_hash)
        bad, shape = None, None
        if load is not None:
            transfer_id, blocks, shape = load
            bad = [k for k, b in enumerate(blocks) if bytes(mm[b * bs : (b + 1) * bs]) != pattern(7, k, bs)]
            conn.update_connector_output(
                SimpleNamespace(ec_connector_worker_meta=ECCPUWorkerMetadata(completed_loads=[transfer_id]))
            )
        say(
            ready=ready,
            failed=sorted(failed),
            loaded=load is not None,
            shape=list(shape) if shape else None,
            bad_blocks=bad,
            **info,
        )
    sys.stdin.readline()
    del mm
    conn.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
