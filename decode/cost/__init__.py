"""The cost model: what a step costs on a machine, apart from who decides it.

``table`` (the latency table and a batch's pass ratios: T̂ of an action, numpy only), ``measure`` (timing both
models' passes on the running machine, cached once per machine), ``pricing`` (a set of trees or a batch step priced on
a table) and ``throughput`` (the stream throughput that labelled roots predict). Policies read it; it reads no
policy.
"""
