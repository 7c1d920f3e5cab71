"""PipelineMixin: the LightningModule side of pipeline training (blocks, loss, steps)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from torch import Tensor, nn

from lightning_pipe.runtime.engine import PipelineEngine
from lightning_pipe.runtime.ties import alias_names

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class PipelineMixin:
    """Mix into a LightningModule whose model is a chain of blocks to train it as a pipeline.

    Define :meth:`pipeline_blocks` and :meth:`pipeline_loss`, set ``self.automatic_optimization
    = False`` and call :meth:`pipeline_step` from ``training_step``. Each block is called with
    the previous block's output: a Tensor as one argument, a tuple unpacked into positional
    arguments. Blocks must return a Tensor or a tuple of Tensors.

    Example::

        class GPT(PipelineMixin, L.LightningModule):
            def pipeline_blocks(self):
                return [self.embed, *self.blocks, self.head]

            def pipeline_loss(self, output, batch):
                return F.cross_entropy(output.flatten(0, 1), batch[1].flatten())

            def training_step(self, batch, batch_idx):
                loss = self.pipeline_step(batch)
                self.log("train_loss", loss, prog_bar=True)
    """

    _pipeline_engine: Optional[PipelineEngine] = None
    _pipeline_epoch: int = 0
    _pipeline_updates: int = 0

    def pipeline_blocks(self) -> list[nn.Module]:
        """The model as an ordered chain of blocks (e.g. embedding, transformer blocks, head)."""
        raise NotImplementedError(f"{type(self).__name__} must implement pipeline_blocks() to be pipelined")

    def pipeline_loss(self, output: Any, batch: Any) -> Tensor:
        """Mean-reduced loss of one microbatch, computed on the last stage from the chain's output."""
        raise NotImplementedError(f"{type(self).__name__} must implement pipeline_loss(output, batch)")

    def configure_stage(self, blocks: list[nn.Module], tp_mesh: Optional["DeviceMesh"]) -> None:
        """Change a stage's blocks on the rank that runs it: apply tensor parallel (or any per-stage change).

        :class:`~lightning_pipe.PipelineStrategy` calls it once for each stage this rank runs,
        after the stage's blocks are on the device and the other stages' blocks are dropped, and
        before ``configure_optimizers``, so the optimizer holds the parameters this hook leaves.
        It plays the role of Lightning's ``configure_model`` under ``ModelParallelStrategy``, for
        one stage: the whole mesh is ``self.trainer.strategy.device_mesh``.

        Args:
            blocks: the stage's blocks, in chain order (the entries of :meth:`pipeline_blocks`).
            tp_mesh: the 1-D DeviceMesh over the ``tensor_parallel`` ranks this stage replica is
                split over (``device_mesh["tensor_parallel"]``), or ``None`` with
                ``tensor_parallel=1``. These ranks receive the same activations and the same
                batch; each block's output must be whole (replicated) on every one of them, as
                a ``RowwiseParallel`` layer's is, since each rank sends its own copy on to its
                neighbour stage's rank of the same tensor-parallel index.

        Example::

            def configure_stage(self, blocks, tp_mesh):
                if tp_mesh is None:
                    return
                for block in blocks:
                    parallelize_module(block, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        """

    def pipeline_inputs(self, batch: Any) -> Any:
        """What stage 0 feeds the first block: by default the batch itself, or its first item."""
        return batch[0] if isinstance(batch, (tuple, list)) else batch

    @property
    def pipeline_engine(self) -> PipelineEngine:
        """This rank's engine; set by :class:`~lightning_pipe.PipelineStrategy` during setup."""
        if self._pipeline_engine is None:
            raise RuntimeError(
                "pipeline_step()/pipeline_forward() need the model to be set up by "
                "Trainer(strategy=PipelineStrategy(...)) (or strategy='pipeline')"
            )
        return self._pipeline_engine

    def pipeline_step(self, batch: Any) -> Tensor:
        """Train on ``batch``: run the schedule, the replica all-reduce and the optimizer step.

        Also steps LR schedulers (interval "step" after each optimizer step, interval "epoch"
        at the first step of each new epoch), since manual optimization leaves that to us.
        Lightning counts one optimizer step per call, so ``trainer.global_step`` and
        ``max_steps`` mean training steps for every schedule.

        Returns:
            The mean loss of this batch (this pipeline's shard) on every stage of the pipeline.
            With ``schedule="2bw"`` it is still this batch's loss, computed on the 1-stale
            weights the batch ran on; this batch's update is applied during the next call
            (or at the next drain: before validation, checkpoints and the end of fit).
        """
        optimizer = self.optimizers()
        if isinstance(optimizer, list):
            raise ValueError(
                f"pipeline training supports one optimizer, configure_optimizers returned {len(optimizer)}"
            )
        self._step_epoch_schedulers()
        batch = self.trainer.strategy.replica_batch(batch)  # a global batch, when the layout may change
        loss = self.pipeline_engine.train_step(batch, optimizer.optimizer, self._step_interval_schedulers)
        optimizer.step()  # lets Lightning count the step; PipelineStrategy.optimizer_step does not step again
        return loss

    def pipeline_forward(self, batch: Any, with_loss: bool = False) -> Any:
        """Forward-only pass through the pipeline (validation, test, predict).

        Returns:
            The chain's output for the whole batch, or with ``with_loss=True`` the batch's mean
            :meth:`pipeline_loss`, on every stage of the pipeline.
        """
        return self.pipeline_engine.forward(batch, with_loss=with_loss)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint keeps a tied parameter once, under its first name; give its other names
        the same tensor, since a plain ``load_state_dict`` wants every name."""
        state = checkpoint.get("state_dict")
        if state is not None:
            for alias, kept in alias_names(self).items():  # type: ignore[arg-type]
                if kept in state and alias not in state:
                    state[alias] = state[kept]
        super().on_load_checkpoint(checkpoint)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drain a 2BW pipeline first: its in-flight gradients live in ``.grad`` until their
        deferred step (Lightning clears gradients when evaluation starts)."""
        if self._pipeline_engine is not None:
            self._pipeline_engine.drain()
        super().zero_grad(set_to_none=set_to_none)  # type: ignore[misc]

    def _step_interval_schedulers(self) -> None:
        self._pipeline_updates += 1
        for config in self.trainer.lr_scheduler_configs:
            if config.interval == "step" and self._pipeline_updates % config.frequency == 0:
                self._step_scheduler(config)

    def _step_epoch_schedulers(self) -> None:
        epoch = self.trainer.current_epoch
        if epoch == self._pipeline_epoch:
            return
        self._pipeline_epoch = epoch
        for config in self.trainer.lr_scheduler_configs:
            if config.interval == "epoch" and epoch % config.frequency == 0:
                self._step_scheduler(config)

    def _step_scheduler(self, config: Any) -> None:
        if config.reduce_on_plateau:
            metric = self.trainer.callback_metrics.get(config.monitor)
            if metric is not None:
                config.scheduler.step(metric)
            return
        config.scheduler.step()
