"""Float linear layers stored input-major, (in, out), for batch-1 decoding.

At one row a linear layer is a pass over its weight. PyTorch's CPU path for `F.linear`
(weight (out, in)) reads a wide layer's weight more slowly than `x @ W` with W stored
(in, out): measured on 2 AVX2 cores, float32, one row, cold weights: GPT-2's stacked q/k/v
(2304 x 768) 595 -> 426 us, its MLP input (3072 x 768) 752 -> 531 us and its output head
(50257 x 768) 10.4 -> 6.8 ms; a narrow layer (768 x 3072) is slower that way (556 -> 734
us), so only layers with at least as many outputs as inputs are stored input-major.
Same product, another summation order: results agree to float rounding.

Shape legend: K input features, N output features, M rows.
"""

from __future__ import annotations

from torch import Tensor, nn

from qkv.runtime.linear.quantized import replace_linears


class InputMajorLinear(nn.Module):
    """y = x @ weight_t + bias with weight_t stored (K, N) contiguous (see the module docstring)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)  # (K, N)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    @property
    def weight(self) -> Tensor:
        """The (N, K) weight as nn.Linear stores it (a view), for code that reads weights."""
        return self.weight_t.t()

    def forward(self, x: Tensor) -> Tensor:
        y = x @ self.weight_t  # (..., K) @ (K, N) -> (..., N)
        return y if self.bias is None else y + self.bias

    def kernel_tensors(self) -> list[Tensor] | None:
        """None: made only where qkv's kernels cannot be built, it runs as a module (qkv.runtime.linear.kernel)."""
        return None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, input-major"


def store_input_major(model: nn.Module) -> int:
    """Replace every float nn.Linear with out_features >= in_features by an InputMajorLinear,
    in place (a tied output head gets its own copy). Returns the count."""
    return replace_linears(model, InputMajorLinear, where=lambda linear: (
        linear.out_features >= linear.in_features and linear.weight.is_floating_point()))
