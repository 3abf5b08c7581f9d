import torch, time, statistics
torch.set_num_threads(2)
a = torch.ones(256*1024*1024, dtype=torch.float32)  # 1 GiB
def run():
    t=time.perf_counter(); a.sum(); return time.perf_counter()-t
run()
ts=[run() for _ in range(7)]
print("read GB/s (2 threads, torch sum over 1 GiB):", round(a.numel()*4/statistics.median(ts)/1e9,1))
