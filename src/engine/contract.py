"""What a model must be for this template, checked at start with one line each (docs/your-model.md, The contract).

Hyperparameters must be plain values so every checkpoint loads with torch.load(weights_only=True); the forward is
checked on two images on the meta device (no memory, no compute) before any data is read."""

from typing import Any

from engine.errors import UserError

PLAIN = (str, int, float, bool, type(None))


def _first_unplain(value: Any, path: str) -> tuple[str, Any] | None:
    """(where, what) of the first value a weights-only checkpoint cannot hold, or None."""
    import torch

    if isinstance(value, PLAIN) or isinstance(value, torch.Tensor):
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, PLAIN):
                return f"{path} key {key!r}", key
            found = _first_unplain(item, f"{path}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = _first_unplain(item, f"{path}[{i}]")
            if found:
                return found
        return None
    return path, value


def _check_plain(owner: Any, kind: str) -> None:
    found = _first_unplain(dict(getattr(owner, "hparams", {}) or {}), "hparams")
    if found is None:
        return
    where, value = found
    what = type(value).__name__
    key = where.split("[")[1].split("]")[0] if "[" in where else where
    raise UserError(
        f"{type(owner).__name__}.{where} is a {what}: a {kind} checkpoint holding it would not load safely "
        f"(torch's weights_only loading refuses it); call self.save_hyperparameters(ignore=[{key}]) in "
        f"{type(owner).__name__}.__init__"
    )


def _takes_more_than_images(model: Any) -> bool:
    """The net's forward has a second argument without a default (the classifier calls net(images))."""
    import inspect

    net = getattr(model, "net", model)
    try:
        parameters = list(inspect.signature(net.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in positional and p.default is inspect.Parameter.empty for p in parameters) > 1


def _named(model: Any) -> str:
    """The user's net inside the template's classifier, else the module itself."""
    net = getattr(model, "net", None)
    return type(net if net is not None else model).__name__


def check(model: Any, datamodule: Any, test: bool = False, train: bool = True) -> None:
    import lightning.pytorch as L
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if not isinstance(model, L.LightningModule):
        raise UserError(
            f"model._target_ builds a {type(model).__name__}, not a LightningModule; put an nn.Module inside the "
            "classifier instead: model=tiny_cnn model.net._target_=<your net> (docs/your-model.md)"
        )
    if test and not is_overridden("test_step", model):
        raise UserError(
            f"test=true, but {type(model).__name__} defines no test_step: add one, or pass test=false (fit only)"
        )
    if train and not any(p.requires_grad for p in model.parameters()):
        raise UserError(
            f"{_named(model)} has no weights to train (no parameter that requires a gradient); give it some, or "
            "evaluate it without training: train=false"
        )
    _check_plain(model, "model's")
    if datamodule is not None:
        _check_plain(datamodule, "data module's")


def _data_shape(data_config: Any) -> tuple[int, int, int] | None:
    """(channels, height, width) of the data's images, from its config alone; None where it does not say."""
    from engine.data import spec

    try:
        found = spec.input_spec(data_config)
    except Exception:  # a data module that does not say what its images look like: nothing to check against
        return None
    return found.channels, found.height, found.width


def check_fits(model: Any, datamodule: Any, data_config: Any) -> None:
    """The model's forward on two images shaped like the data's, and a classifier's outputs against the data's
    classes: a mismatch ends here in one line, not in the first step with a long traceback."""
    import torch

    shape = _data_shape(data_config)
    if shape is None or not isinstance(model, torch.nn.Module):
        return
    x = torch.zeros(2, *shape, device="meta")
    weights = {k: torch.empty_like(v, device="meta") for k, v in model.state_dict(keep_vars=True).items()}
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = torch.func.functional_call(model, weights, (x,), strict=False)
    except NotImplementedError:  # an op without a meta kernel: nothing can be said here
        return
    except Exception:
        try:  # again for real, on two images of zeros: its error says more than the meta kernel's
            with torch.no_grad():
                out = model(torch.zeros(2, *shape))
        except Exception as e:
            detail = " ".join(str(e).split())[:240]
            if _takes_more_than_images(model):  # forward(x, mask): not something the data can fix
                raise UserError(
                    f"{_named(model)}'s forward takes more than the images ({type(e).__name__}: {detail}); the "
                    "classifier calls net(images): give the other arguments defaults, or compute them inside"
                ) from e
            settable = [f"data.{key}" for key in ("channels", "image_size") if key in (data_config or {})]
            data_side = " and ".join(settable) + ", or " if settable else ""
            raise UserError(
                f"{_named(model)} does not take the data's images ({shape[0]} channels, {shape[1]}x{shape[2]})"
                f": {type(e).__name__}: {detail}; make them fit: {data_side}the model's input size in its config"
            ) from e
    finally:
        model.train(was)
    classes = getattr(datamodule, "num_classes", None)
    wanted = getattr(model, "num_classes", None)
    if _is_classifier(model):  # it trains on a tensor of class scores; a module of yours, on its own
        _check_scores(model, weights, x, out)
    if isinstance(classes, int) and isinstance(wanted, int) and isinstance(out, torch.Tensor) and out.dim() == 2:
        if out.shape[1] != classes:
            fix = (
                f"set model.num_classes={classes}"
                if wanted != classes  # else the net does not size its last layer from the value it is given
                else f"make its last layer's size the net's num_classes argument, not {out.shape[1]}"
            )
            raise UserError(
                f"{_named(model)} has {out.shape[1]} outputs (model.num_classes={wanted}) but the data has "
                f"{classes} classes: {fix}"
            )


def _is_classifier(model: Any) -> bool:
    """The classifier pattern (the template's ImageClassifier, or a module of yours written like it): a `net` that
    returns class scores, and `num_classes` of them."""
    import torch

    classes = getattr(model, "num_classes", None)
    return isinstance(getattr(model, "net", None), torch.nn.Module) and isinstance(classes, int) and classes > 0


def _check_scores(model: Any, weights: dict[str, Any], x: Any, out: Any) -> None:
    """A classifier's forward returns one tensor (batch, classes), in evaluation and in training (torchvision's
    googlenet and inception_v3 add their auxiliary heads' logits in training only): checked on the meta device."""
    import torch

    when = ""
    if isinstance(out, torch.Tensor):
        was = model.training
        model.train()
        try:
            with torch.no_grad():
                out = torch.func.functional_call(model, weights, (x,), strict=False)
        except Exception:  # what fails only in training: the first step says it
            return
        finally:
            model.train(was)
        when = " in training"
    if not isinstance(out, torch.Tensor):
        raise UserError(
            f"{_named(model)} returns a {type(out).__name__}{when}, not a tensor of class scores (batch, classes): "
            "return the logits alone (torchvision's googlenet and inception_v3: aux_logits=False)"
        )
