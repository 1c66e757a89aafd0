"""A DAG on local workers from Python: two producers, one consumer, a chip kernel.

Run: ``.venv/bin/python examples/pipeline.py``
"""

from simpler_daemon import Tag, TaskArgs, Worker
from simpler_daemon.examples.tasks import add, fill

with Worker(num_sub_workers=2, num_chips=1) as w:
    h_fill, h_add = w.register(fill), w.register(add)
    k_scale = w.register("simpler_daemon.examples.tasks:scale_kernel", kind="chip")
    a, b, out = (w.alloc((1024,), "float64") for _ in range(3))

    def orch(o, args, config):
        o.submit_sub(h_fill, TaskArgs().add_tensor(a, Tag.OUTPUT).add_scalar(1))
        o.submit_sub(h_fill, TaskArgs().add_tensor(b, Tag.OUTPUT).add_scalar(2))
        o.submit_sub(h_add, TaskArgs().add_tensor(a, Tag.INPUT).add_tensor(b, Tag.INPUT)
                     .add_tensor(out, Tag.OUTPUT))
        o.submit_next_level(k_scale, TaskArgs().add_tensor(out, Tag.INOUT).add_scalar(10), worker=0)

    w.run(orch)
    print("out[:4] =", out[:4])  # (1 + 2) * 10 = 30
