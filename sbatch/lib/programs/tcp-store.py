import datetime, signal, sys
import torch.distributed as dist
signal.signal(signal.SIGTERM, signal.SIG_IGN)
store = dist.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=True, wait_for_workers=False,
                      multi_tenant=True, timeout=datetime.timedelta(seconds=300))
while True:
    signal.pause()
