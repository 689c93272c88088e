# torchrun's rendezvous store, hosted by the first node's task in a process of its own (task.sh),
# so that it outlives the first launcher until every node's launcher has exited (pytorch#69520).
import datetime, signal, sys
import torch.distributed as dist
signal.signal(signal.SIGTERM, signal.SIG_IGN)
store = dist.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=True, wait_for_workers=False,
                      multi_tenant=True, timeout=datetime.timedelta(seconds=300))
while True:
    signal.pause()
