"""The shared host region: its files (`files`, any process) and its mapping (`mapping`,
worker processes)."""
