"""The shared host region: its files (`files`, any process), its mapping (`mapping`,
worker processes), the reservation of its pages (`page_reserver`, the creator) and
the watermark that reservation publishes (`reservation`, any process)."""
