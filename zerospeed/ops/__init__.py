"""DeepSpeed's `deepspeed.ops`, in pure PyTorch (no compiled ops): the optimizers client code
names directly (adam, adagrad, lion) and sparse attention."""
from zerospeed._lazy import lazy_submodules

__getattr__ = lazy_submodules(__name__)
