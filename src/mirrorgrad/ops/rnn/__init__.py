"""The RNN operator family (LSTM, GRU, RNN-tanh, RNN-relu): ``rnn`` runs a whole stack.

- ``dispatch``: ``rnn(...)``, which implementation runs (``impl="auto"`` times them);
  ``time_model``: the fitted time of each implementation where it cannot time.
- ``op``: ``mirrorgrad::rnn_forward`` / ``rnn_backward`` (torch.library) with their
  autograd and formulas; it runs one implementation per layer and direction, handing
  it a ``layer_call.LayerCall``.
- The implementations: ``reference`` (plain PyTorch: CPU path, test oracle; its
  docstring is the per-layer contract), ``kernels`` (Triton, one launch per step) and
  ``persistent`` (Triton, one launch per layer: ``persistent_kernels`` its device code,
  ``persistent_plan`` its launch layout, ``persistent_buffers`` and ``persistent_memory``
  its buffers and their bytes, ``persistent_probes`` what benchmarks record).
- Shared by the Triton layers: ``step_loop`` (the loop's configuration, checks, input
  GEMM, backward chunks), ``triton_math`` (device functions), ``tuning`` (the kernels'
  knobs, ``StepTuning`` and ``PersistentTuning``), ``cuda_graphs`` (the CUDA Graph cache
  their loops replay from).
- ``cell_modes``: the cells' names, gates and memory modes.
"""

from mirrorgrad.ops.rnn.dispatch import IMPLS, MEMORY, rnn
from mirrorgrad.ops.rnn.op import reverse_within_lengths

__all__ = ["IMPLS", "MEMORY", "reverse_within_lengths", "rnn"]
