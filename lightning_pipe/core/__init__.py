"""The pure core: the layout value (PipelinePlan), the rank topology and chain partitioning."""
