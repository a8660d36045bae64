"""FSDP units: which modules become units and what each flattens, one unit's flat parameter
(flatten, shard, all-gather, views, the gradient it carries between backwards), and the
all-gather schedule run across units."""
