"""Correctness over timm's vision models: small random-weight models through ember on the CPU.

    python -m benchmarks.timm_sweep [NAME ...] [--modes infer,train,dyn,channels_last] [--json out.json]

The counterpart of benchmarks/architectures.py (whose comparison and process runner it shares) for
what vision models stress and language models do not: convolutions of every kind (depthwise,
grouped, dilated, strided, "same" padding), BatchNorm, GroupNorm and LayerNorm2d, pooling,
squeeze-excite, hard-swish, window attention with rolls, relative position biases, interpolation,
fold/unfold. Each model (about 55, narrowed and shortened through timm's own arguments, built with
`pretrained=False`: nothing downloaded) runs in its own process under EMBER_STRICT=1 with a fresh
cache, in up to four modes:
  infer          an eval forward (twice: the second call through the compiled code again);
  train          a train-mode forward (dropout and drop path off), a loss, backward: the outputs,
                 the loss, every gradient and BatchNorm's updated running statistics;
  dyn            three eval calls at other batch sizes, and image sizes where the model takes any,
                 the second of which makes dynamo recompile with symbolic shapes;
  channels_last  an eval forward with the model and its input in channels-last memory format.
The reference is the model copied to float64 and run eagerly; ember is flagged (WRONG) where its
error, relative to the reference's largest value, is above 1e-4 and more than 10 times eager
float32's. Needs timm (not one of ember's dependencies).
"""

from __future__ import annotations

import copy
import os
import sys
import time

from benchmarks.architectures import parse_sweep_args, rel_err, run_children, run_modes, summarize

MODES = os.environ.get("EMBER_TIMM_MODES", "infer,train,dyn,channels_last").split(",")  # (--modes)
THREADS = int(os.environ.get("EMBER_TIMM_THREADS", "1"))  # (--threads)


# ----------------------------------------------------------------------------------------
# model zoo: name -> (timm model, its arguments, image size, flags)
# ----------------------------------------------------------------------------------------

# flags: "fixed" the model takes one image size only (dyn mode changes the batch alone);
#        "no_train" train mode skipped (named with why in NO_TRAIN_WHY)
SWIN = dict(embed_dim=32, depths=(2, 2), num_heads=(2, 4), window_size=4)
VIT = dict(embed_dim=64, depth=2, num_heads=2)
MIXER = dict(img_size=64, patch_size=8, num_blocks=2, embed_dim=64)
ZOO = {
    # ---- residual networks
    "resnet10t": ("resnet10t", {}, 64, ""),
    "resnet_avgdown": ("resnet26d", dict(layers=(1, 1, 1, 1)), 64, ""),
    "resnext26ts": ("resnext26ts", {}, 64, ""),
    "seresnet18": ("seresnet18", dict(layers=(1, 1, 1, 1)), 64, ""),
    "skresnet18": ("skresnet18", dict(layers=(1, 1, 1, 1)), 64, ""),
    "resnest14d": ("resnest14d", {}, 64, ""),
    "res2net": ("res2net50_14w_8s", dict(layers=(1, 1, 1, 1)), 64, ""),
    "resnetv2_bit": ("resnetv2_50x1_bit", {}, 64, ""),  # weight-standardized convolutions
    "regnetx_002": ("regnetx_002", {}, 64, ""),
    "regnety_002": ("regnety_002", {}, 64, ""),
    "nf_regnet_b0": ("nf_regnet_b0", {}, 64, ""),
    "nf_resnet26": ("nf_resnet26", {}, 64, ""),
    "dpn48b": ("dpn48b", {}, 64, ""),
    "densenet": ("densenet121", dict(growth_rate=8, block_config=(2, 2, 2, 2)), 64, ""),
    "dla46x_c": ("dla46x_c", {}, 64, ""),
    "hrnet_w18_small": ("hrnet_w18_small", {}, 64, ""),
    "inception_v3": ("inception_v3", {}, 96, ""),
    "xception41": ("xception41", {}, 64, ""),
    "cs3darknet_focus_s": ("cs3darknet_focus_s", {}, 64, ""),
    "selecsls42b": ("selecsls42b", {}, 64, ""),
    "ese_vovnet19b_dw": ("ese_vovnet19b_dw", {}, 64, ""),
    "gernet_s": ("gernet_s", {}, 64, ""),
    "repvgg_a0": ("repvgg_a0", {}, 64, ""),
    # ---- mobile networks
    "efficientnet_b0": ("efficientnet_b0", {}, 64, ""),
    "tf_efficientnet_b0": ("tf_efficientnet_b0", {}, 64, ""),  # "same" padding
    "tinynet_e": ("tinynet_e", {}, 64, ""),
    "mixnet_s": ("mixnet_s", {}, 64, ""),
    "mobilenetv3_small": ("mobilenetv3_small_050", {}, 64, ""),
    "mobilenetv4_conv_small": ("mobilenetv4_conv_small", {}, 64, ""),
    "mnasnet_small": ("mnasnet_small", {}, 64, ""),
    "lcnet_050": ("lcnet_050", {}, 64, ""),
    "ghostnet_050": ("ghostnet_050", {}, 64, ""),
    "ghostnetv2": ("ghostnetv2_100", {}, 64, ""),
    "rexnet_100": ("rexnet_100", {}, 64, ""),
    "mobileone_s0": ("mobileone_s0", {}, 64, ""),
    "repvit_m0_9": ("repvit_m0_9", {}, 64, ""),
    "hgnetv2_b0": ("hgnetv2_b0", {}, 64, ""),
    "efficientvit_b0": ("efficientvit_b0", {}, 64, ""),
    "fasternet_t0": ("fasternet_t0", {}, 64, ""),
    # ---- convolutional "transformers" and MLPs
    "convnext_atto": ("convnext_atto", dict(depths=(1, 1, 2, 1)), 64, ""),
    "convmixer": ("convmixer.ConvMixer", dict(dim=64, depth=2, kernel_size=5, patch_size=4), 64, ""),
    "poolformer": ("poolformer_s12", {}, 64, ""),
    "poolformerv2": ("poolformerv2_s12", {}, 64, ""),
    "edgenext_xx_small": ("edgenext_xx_small", dict(depths=(1, 1, 2, 1)), 64, ""),
    "mambaout_femto": ("mambaout_femto", dict(depths=(1, 1, 2, 1)), 64, ""),
    "starnet_s1": ("starnet_s1", {}, 64, ""),
    "inception_next": ("inception_next_tiny", dict(depths=(1, 1, 1, 1)), 64, ""),
    "mixer": ("mlp_mixer.MlpMixer", MIXER, 64, "fixed"),
    "resmlp": (
        "mlp_mixer.MlpMixer",
        dict(block_layer="ResBlock", norm_layer="Affine", mlp_ratio=4, **MIXER),
        64,
        "fixed",
    ),
    "gmlp": (
        "mlp_mixer.MlpMixer",
        dict(block_layer="SpatialGatingBlock", mlp_layer="GatedMlp", mlp_ratio=6, **MIXER),
        64,
        "fixed",
    ),
    # ---- vision transformers
    "vit": ("vit_tiny_patch16_224", dict(img_size=64, patch_size=8, **VIT), 64, "fixed"),
    "deit_distilled": ("deit_tiny_distilled_patch16_224", dict(img_size=64, patch_size=8, **VIT), 64, "fixed"),
    "beit": ("beit_base_patch16_224", dict(img_size=64, patch_size=8, **VIT), 64, "fixed"),
    "eva02": ("eva02_tiny_patch14_224", dict(img_size=56, **VIT), 56, "fixed"),
    "cait": ("cait_xxs24_224", dict(img_size=64, patch_size=8, depth=2), 64, "fixed"),
    "xcit": ("xcit_nano_12_p16_224", dict(img_size=64, depth=2), 64, ""),
    "convit": ("convit_tiny", dict(img_size=64, depth=2, local_up_to_layer=1), 64, "fixed"),
    "swin": ("swin_tiny_patch4_window7_224", dict(img_size=64, **SWIN), 64, "fixed"),
    "swinv2": ("swinv2_tiny_window8_256", dict(img_size=64, **SWIN), 64, "fixed"),
    "coat_lite": ("coat_lite_tiny", dict(img_size=64), 64, "fixed"),
    "levit": ("levit_128s", dict(img_size=64), 64, "fixed"),
    "pit": ("pit_ti_224", dict(img_size=64), 64, "fixed"),
    "pvt_v2_b0": ("pvt_v2_b0", {}, 64, ""),
    "mobilevit_xxs": ("mobilevit_xxs", {}, 64, ""),
    "mobilevitv2": ("mobilevitv2_050", {}, 64, ""),
    "efficientformer_l1": ("efficientformer_l1", dict(depths=(1, 1, 1, 1), num_vit=1), 224, "fixed"),
    "efficientformerv2": ("efficientformerv2_s0", dict(img_size=64), 64, "fixed"),
    "maxvit": ("maxvit_pico_rw_256", dict(img_size=64), 64, "fixed"),
    "coatnet": ("coatnet_pico_rw_224", dict(img_size=64), 64, "fixed"),
    "volo": (
        "volo.VOLO",
        dict(img_size=64, layers=(1, 1, 1, 1), embed_dims=(64, 128, 128, 128), num_heads=(2, 4, 4, 4)),
        64,
        "fixed",
    ),
    "tiny_vit": ("tiny_vit_5m_224", {}, 224, "fixed"),  # attention biases for 224 only
    "davit": ("davit_tiny", dict(depths=(1, 1, 1, 1)), 64, ""),
    "gcvit": ("gcvit_xxtiny", dict(img_size=64), 64, "fixed"),
}
NO_TRAIN_WHY: dict[str, str] = {}

B, HW = 2, 64  # batch, image size of the first call
DYN_SIZES = [(2, 0), (3, 32), (2, 64)]  # dyn mode: (batch, image size added) per call; 0 only where "fixed"


def build(name):
    """`timm.create_model`, or for a model whose arguments timm's entry point fixes, its class
    ("module.Class"; string arguments naming classes of that module)."""
    import importlib

    import timm

    timm_name, kwargs, _, _ = ZOO[name]
    if "." in timm_name:
        module_name, class_name = timm_name.split(".")
        module = importlib.import_module(f"timm.models.{module_name}")
        kwargs = {k: getattr(module, v) if isinstance(v, str) else v for k, v in kwargs.items()}
        return drop_path_off(getattr(module, class_name), num_classes=10, **kwargs)
    return drop_path_off(timm.create_model, timm_name, pretrained=False, num_classes=10, drop_rate=0.0, **kwargs)


def drop_path_off(make, *args, **kwargs):
    """drop_path_rate=0 where the model takes it (most of timm's but a few CNNs)."""
    try:
        return make(*args, drop_path_rate=0.0, **kwargs)
    except TypeError as e:
        if "drop_path_rate" not in str(e):
            raise
        return make(*args, **kwargs)


def image(gen, batch, hw):
    import torch

    return torch.randn(batch, 3, hw, hw, generator=gen)


# ----------------------------------------------------------------------------------------
# child: checks for one model
# ----------------------------------------------------------------------------------------


def outputs_of(out):
    """A model's floating outputs, named: a tensor, or the tuple of a distilled model in train mode."""
    import torch

    if isinstance(out, torch.Tensor):
        return [("out", out)]
    return [(f"out[{i}]", x) for i, x in enumerate(out) if isinstance(x, torch.Tensor) and x.is_floating_point()]


def loss_of(out, gen_seed=2):
    """Every output against fixed random weights: a scalar whose gradient reaches each output element."""
    import torch

    total = 0
    for i, (_, x) in enumerate(outputs_of(out)):
        gen = torch.Generator().manual_seed(gen_seed + i)
        w = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.dtype)
        total = total + (x * w).sum()
    return total


def stats_of(model):
    """BatchNorm's running statistics (and any other floating buffer), named."""
    return [(f"buffer:{n}", b) for n, b in model.named_buffers() if b.is_floating_point()]


def no_dropout(model):
    """Dropout modules at p=0 and drop path off, for train mode's three copies to agree."""
    import torch

    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.p = 0.0
        for k, v in list(vars(m).items()):
            if isinstance(v, float) and "drop" in k.lower():
                setattr(m, k, 0.0)


def triples(ref, eager, ember):
    return [((n, r), (n, e), (n, g)) for (n, r), (_, e), (_, g) in zip(ref, eager, ember)]


def check(name, mode):
    import torch

    import ember

    ember.metrics.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    torch.manual_seed(0)
    model = build(name)
    no_dropout(model)
    model.train(mode == "train")
    hw = ZOO[name][2]
    gen = torch.Generator().manual_seed(1)
    x = image(gen, B, hw)
    if mode == "channels_last":
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    m64, m_eager, m_ember = copy.deepcopy(model).double(), copy.deepcopy(model), copy.deepcopy(model)
    res = {"name": name, "mode": mode}
    t0 = time.time()
    if mode == "train":
        pairs = check_train(m64, m_eager, m_ember, x, res)
    elif mode == "dyn":
        cm = torch.compile(m_ember, backend="ember")
        pairs = []
        for i, (batch, extra) in enumerate(DYN_SIZES):
            size = hw + (0 if "fixed" in ZOO[name][3] else extra)
            xi = image(gen, batch, size)
            with torch.no_grad():
                ref, eag, got = outputs_of(m64(xi.double())), outputs_of(m_eager(xi)), outputs_of(cm(xi))
            pairs += [((f"call{i}({batch},{size}):{a[0]}", a[1]), b, c) for a, b, c in zip(ref, eag, got)]
    else:
        with torch.no_grad():
            ref, eag = outputs_of(m64(x.double())), outputs_of(m_eager(x))
            cm = torch.compile(m_ember, backend="ember")
            got = outputs_of(cm(x))
            got2 = outputs_of(cm(x))
        pairs = triples(ref, eag, got)
        rerun = max((rel_err(a[1], b[1])[0] for a, b in zip(got2, got)), default=0.0)
        if rerun > 0:
            res["rerun_diff"] = rerun
        if mode == "channels_last" and not got[0][1].is_contiguous(memory_format=torch.channels_last):
            if eag[0][1].is_contiguous(memory_format=torch.channels_last) and got[0][1].dim() == 4:
                res["note"] = "output not channels-last where eager's is"
    res["compile_s"] = round(time.time() - t0, 1)
    return summarize(res, pairs)


def check_train(m64, m_eager, m_ember, x, res):
    """Forward, loss, backward in each copy: outputs, loss, gradients and running statistics."""
    import torch

    out64 = m64(x.double())
    loss64 = loss_of(out64)
    loss64.backward()
    oe = m_eager(x)
    le = loss_of(oe)
    le.backward()
    # a second float32 rounding: ReLU's gate at a pre-activation within rounding of 0 (after a norm over a
    # few elements: batch 2 at 2x2) can flip either way, moving a gradient by a whole term of its sum
    m_alt = copy.deepcopy(m_eager).to(memory_format=torch.channels_last)
    for p in m_alt.parameters():
        p.grad = None
    x_alt = x.contiguous(memory_format=torch.channels_last)
    oa = m_alt(x_alt)
    loss_of(oa).backward()
    og = torch.compile(m_ember, backend="ember")(x)
    lg = loss_of(og)
    lg.backward()
    pairs = [(("loss", loss64), ("loss", le), ("loss", lg))]
    pairs += triples(outputs_of(out64), outputs_of(oe), outputs_of(og))
    pairs += triples(stats_of(m64), stats_of(m_eager), stats_of(m_ember))
    params = zip(m64.named_parameters(), m_eager.parameters(), m_alt.parameters(), m_ember.parameters())
    for (pn, p64), pe, pa, pg in params:
        if p64.grad is None:
            continue
        if pg.grad is None:
            res.setdefault("grad_missing", []).append(pn)
            continue
        pe = max((pe, pa), key=lambda q: rel_err(q.grad, p64.grad)[0])  # float32's error: the larger of the two
        pairs.append(((f"grad:{pn}", p64.grad), (pn, pe.grad), (pn, pg.grad)))
    return pairs


def modes_of(name):
    return [m for m in MODES if m != "train" or name not in NO_TRAIN_WHY]


def child(name):
    import warnings

    import torch

    torch.set_num_threads(THREADS)
    warnings.filterwarnings("ignore")
    run_modes(name, modes_of(name), lambda mode: check(name, mode))


# ----------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------


def driver(names, json_path=None):
    command = [sys.executable, "-m", "benchmarks.timm_sweep", "--child"]
    results = run_children(names, command, lambda name: len(modes_of(name)), json_path, "timm", THREADS)
    counts: dict[str, int] = {}
    for r in results:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print("totals: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        args = parse_sweep_args("python -m benchmarks.timm_sweep", __doc__, list(ZOO),
                                ("infer", "train", "dyn", "channels_last"), MODES, THREADS, "TIMM")  # fmt: skip
        MODES[:] = args.modes.split(",")
        THREADS = args.threads
        driver(args.names or list(ZOO), args.json)
