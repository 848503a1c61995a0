"""The peer servers, each installed into a virtual environment of its own (their pins conflict with each other and
with the service's), under one cache folder:

    python -m bench.peers.venvs                 # every peer, or only those named: python -m bench.peers.venvs mosec
    python -m bench.peers.venvs --list          # each peer, its pins, and the fixes its install needs

A peer's environment sees the project's environment after its own packages (a `.pth` file naming the project's
site-packages, the last entry of its path): every server runs the same torch build and loads the checkpoint with
the same `model.checkpoint`, while a peer's own pins (its web framework, pydantic, numpy) win over the project's.
The folder is `$VIT_PEERS_HOME`, else `~/.cache/vit-serve/peers`; an environment is made again only when its
requirements change.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Peer:
    name: str
    title: str  # as its docs name it
    requirements: tuple[str, ...]
    fixes: tuple[str, ...] = field(default=())  # what its install or start needs beyond its docs, and why
    distribution: str = ""  # the package whose version the results name (default: the first requirement's)

    @property
    def package(self) -> str:
        return self.distribution or self.requirements[0].split("[")[0].split("=")[0].split("<")[0]


PEERS: dict[str, Peer] = {
    p.name: p
    for p in (
        Peer("litserve", "LitServe", ("litserve==0.2.19",)),
        Peer("mosec", "mosec", ("mosec==0.9.8",)),
        Peer(
            "triton",
            "NVIDIA Triton (PyTriton)",
            ("nvidia-pytriton==0.7.0",),
            (
                "PyTriton's helper process can load the system's libpython instead of the interpreter's "
                "(triton-inference-server/pytriton#51): the server starts with LD_LIBRARY_PATH set to the "
                "interpreter's LIBDIR.",
            ),
        ),
        Peer(
            "mlserver",
            "MLServer",
            ("mlserver==1.7.1", "uvloop<0.22"),
            ("MLServer 1.7 fails to start with uvloop 0.22 (SeldonIO/MLServer#2286): uvloop<0.22 is pinned.",),
        ),
        Peer(
            "torchserve",
            "TorchServe",
            ("torchserve==0.12.0", "torch-model-archiver==0.12.0", "pyyaml"),
            (
                "TorchServe's frontend is Java: a JRE from the system (Debian: openjdk-17-jre-headless).",
                "TorchServe imports yaml without declaring it (pytorch/serve#2013): pyyaml is installed beside it.",
            ),
        ),
        Peer("bentoml", "BentoML", ("bentoml==1.4.40",)),
        Peer("rayserve", "Ray Serve", ("ray[serve]==2.60.0",), distribution="ray"),
        Peer("kserve", "KServe", ("kserve==0.21.0",)),
    )
}


def home() -> Path:
    return Path(os.environ.get("VIT_PEERS_HOME") or Path.home() / ".cache" / "vit-serve" / "peers")


def python(peer: str) -> Path:
    """The interpreter of a peer's environment."""
    return home() / peer / "bin" / "python"


def stamp(peer: Peer) -> str:
    key = "\n".join([*peer.requirements, sys.prefix, sysconfig.get_paths()["purelib"]])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def installed(peer: Peer) -> bool:
    return (home() / peer.name / f".installed-{stamp(peer)}").exists()


def install(peer: Peer) -> Path:
    """The peer's environment, made (or made again, its requirements having changed) when needed."""
    folder = home() / peer.name
    marker = folder / f".installed-{stamp(peer)}"
    if marker.exists():
        return folder
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(folder)], check=True)
    site = Path(
        subprocess.run(
            [str(folder / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    # the project's packages, after the peer's own (a .pth file's paths are appended to sys.path)
    shared = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "zz-vit-serve-project.pth").write_text("".join(f"{p}\n" for p in sorted(shared)))
    pip = [str(folder / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, *peer.requirements], check=True)
    marker.touch()
    return folder


def version(peer: Peer) -> str:
    """The peer's installed version, as its environment reports it."""
    code = f"import importlib.metadata as m; print(m.version({peer.package!r}))"
    done = subprocess.run([str(python(peer.name)), "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.peers.venvs", description=__doc__.split("\n\n")[0])
    p.add_argument("peers", nargs="*", choices=[[], *PEERS], help="default: every peer")
    p.add_argument("--list", action="store_true", help="list the peers, their pins and fixes")
    args = p.parse_args()
    chosen = [PEERS[n] for n in args.peers] or list(PEERS.values())
    for peer in chosen:
        if args.list:
            state = "installed" if installed(peer) else "not installed"
            print(f"{peer.name}: {' '.join(peer.requirements)} ({state})")
            for fix in peer.fixes:
                print(f"    {fix}")
            continue
        print(f"{peer.name}: {home() / peer.name}", flush=True)
        install(peer)
        print(f"{peer.name}: {peer.package} {version(peer)}", flush=True)


if __name__ == "__main__":
    main()
