# Two NIXL agents in one process, "NAME" and "NAME\0x", each send one
# notification to the agent whose metadata is in the file MD_PATH: the
# second one's name, cut at its NUL by NIXL's C API, is the first one's.
# Run by TestNotifSenderNameWithNUL in NIXL's Python environment; it is
# not part of ecxfer.
#
# Usage: nul_sender.py MD_PATH NAME TARGET
# Prints "sent" once both are sent, then keeps both agents progressing
# until stdin closes, and leaves through os._exit (NIXL 1.5.1's wheel
# crashes in its destructors at interpreter exit).
import os
import select
import sys

from nixl._api import nixl_agent, nixl_agent_config

# Keep the control channel off fd 1, where NIXL logs.
ctrl = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)

md_path, name, target = sys.argv[1], sys.argv[2], sys.argv[3]
md = open(md_path, "rb").read()
real = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
forged = nixl_agent(name + "\0x", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
for a in (real, forged):
    a.add_remote_agent(md)
forged.send_notif(target, b"forged-1")
real.send_notif(target, b"real-1")
print("sent", file=ctrl, flush=True)
while True:
    real.get_new_notifs()
    forged.get_new_notifs()
    ready, _, _ = select.select([sys.stdin], [], [], 0.001)
    if ready and sys.stdin.readline() == "":
        break
ctrl.flush()
os._exit(0)
