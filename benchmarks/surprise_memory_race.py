"""The Titans-style memory of ``tests/test_as_written.py`` (``SurpriseMemory``) at level 0: its plan
(the race against the source off) and its source, 25 interleaved calls without gradients and 9
training steps, wall time, one thread, B = 4, L = 256. Run from the repository root on a quiet machine."""
import sys, time, statistics, torch
sys.path.insert(0, "tests")
torch.set_num_threads(1)
torch._dynamo.config.disable = True
import ttt2la
from test_as_written import SurpriseMemory
torch.manual_seed(0)
layer = SurpriseMemory()
x = torch.randn(4, 256, 16)
with ttt2la.race_as_written(False):
    conv = ttt2la.convert(layer, level=0, example_inputs=(x,))
    print(conv.ttt2la_report.layers[0].runtime)
    def t(f):
        s = time.perf_counter(); f(); return (time.perf_counter() - s) * 1e3
    plan, src = [], []
    with torch.no_grad():
        for _ in range(3): conv(x); layer(x)
        for i in range(25):
            for m, acc in ((conv, plan), (layer, src)) if i % 2 else ((layer, src), (conv, plan)):
                acc.append(t(lambda: m(x)))
    q = lambda v: (statistics.median(v), min(v), max(v))
    print("no grad: plan %.2f ms (%.2f-%.2f), source %.2f ms (%.2f-%.2f)" % (*q(plan), *q(src)),
          "ratio %.2fx" % (statistics.median(src) / statistics.median(plan)))
    tp, ts = [], []
    for i in range(9):
        for m, acc in ((conv, tp), (layer, ts)) if i % 2 else ((layer, ts), (conv, tp)):
            acc.append(t(lambda: m(x).square().sum().backward()))
    print("training step: plan %.2f ms (%.2f-%.2f), source %.2f ms (%.2f-%.2f)" % (*q(tp), *q(ts)),
          "ratio %.2fx" % (statistics.median(ts) / statistics.median(tp)))
