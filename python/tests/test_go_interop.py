"""Python <-> Go: the Python class and the Go transport talk to each other
over the ucx backend in both directions, bytes verified and the
notification delivered."""

import base64

from conftest import ShmRegion, pattern

from ecxfer import EcxferDataTransport

NB, BS, SEED = 256, 5120, 41


def make(name):
    reg = ShmRegion(NB * BS)
    t = EcxferDataTransport(
        agent_name=name, base_ptr=reg.addr, num_blocks=NB, block_size_bytes=BS, total_size_bytes=NB * BS
    )
    return t, reg


def test_python_reads_from_go(peers, gopeer):
    go = peers([gopeer, "producer", "go-encoder", str(NB), str(BS), str(SEED)])
    gm = go.recv()
    t, reg = make("py-prefill")
    try:
        peer = t.add_remote_peer(base64.b64decode(gm["md"]), base64.b64decode(gm["desc"]))
        assert peer == "go-encoder"
        go.send(expect_notifs=1)
        local, remote = list(range(200)), [(i * 13) % NB for i in range(200)]
        h = t.post_read(local, peer, remote, b"sess-go:mm-1")
        assert t.wait(h, 30) == "DONE"
        t.release_xfer_handle(h)
        for loc, rem in zip(local, remote):
            assert reg.mm[loc * BS : (loc + 1) * BS] == pattern(SEED, rem, BS), f"block {loc}"
        assert go.recv()["notifs"] == [["py-prefill", "sess-go:mm-1"]]
    finally:
        t.deregister()
        reg.close()
    assert go.finish() == 0


def test_go_reads_from_python(peers, gopeer):
    t, reg = make("py-encoder")
    try:
        for b in range(NB):
            reg.mm[b * BS : (b + 1) * BS] = pattern(SEED, b, BS)
        go = peers([gopeer, "consumer", "go-prefill", str(NB), str(BS)])
        go.recv()
        reads = [
            {"local": list(range(10, 138)), "remote": list(range(128, 256)), "notif": "sess-py:mm-2"},
            {"local": [0], "remote": [255], "notif": ""},
        ]
        go.send(
            md=base64.b64encode(t.get_agent_metadata()).decode(),
            desc=base64.b64encode(t.get_mem_descriptor()).decode(),
            seed=SEED,
            reads=reads,
        )
        res = go.recv()["results"]
        assert res == [{"state": "DONE", "bad_blocks": []}] * 2
        assert t.wait_notifs(30) == {"go-prefill": [b"sess-py:mm-2"]}
        assert go.finish() == 0
    finally:
        t.deregister()
        reg.close()
