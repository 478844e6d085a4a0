"""Checks the Kubernetes recipe under deploy/ against the fields it uses,
and reports what the node-side test needs from it.

  k8s_manifests.py check ROOT       every YAML document under
                                    ROOT/deploy/kubernetes and every
                                    Dockerfile under ROOT/deploy; prints one
                                    line per problem, exits 1 if any
  k8s_manifests.py node ROOT SCRIPT writes the DaemonSet's install script
                                    to SCRIPT and prints its environment:
                                    "host NAME PATH" (a path in a hostPath
                                    volume, as the node sees it), "image
                                    NAME PATH", "group NAME GID", and "cap
                                    NAME" per added capability
  k8s_manifests.py app ROOT         prints, for the first application pod
                                    template: "preload FILE" (LD_PRELOAD's
                                    file in the library directory), "uid N",
                                    "gid N"

Run by crates/apptests/tests/kubernetes.rs (Debian's python3-yaml)."""

import os
import posixpath
import re
import shlex
import sys

import yaml

MANIFESTS = "deploy/kubernetes"
NODE_FILE = "smclo-node.yaml"
# The apiVersion of every kind the recipe uses.
API_VERSIONS = {
    "Namespace": "v1",
    "ServiceAccount": "v1",
    "Service": "v1",
    "ConfigMap": "v1",
    "Pod": "v1",
    "DaemonSet": "apps/v1",
    "Deployment": "apps/v1",
    "StatefulSet": "apps/v1",
    "Job": "batch/v1",
}
NAMESPACED = {"ServiceAccount", "Service", "ConfigMap", "Pod", "DaemonSet",
              "Deployment", "StatefulSet", "Job"}
WORKLOADS = {"DaemonSet", "Deployment", "StatefulSet", "Job"}
HOSTPATH_TYPES = {"", "DirectoryOrCreate", "Directory", "FileOrCreate",
                  "File", "Socket", "CharDevice", "BlockDevice"}
# What the install script must put on the node, and the device's group.
NODE_FILES = ["smclo", "libsmclo_preload.so", "libsmclo_preload_musl.so"]
GROUP_ENV = "SMCLO_GROUP"
DEVICE_ENV = "SMCLO_DEVICE_DIR"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class Problems(list):
    def add(self, where, what):
        self.append(f"{where}: {what}")


def documents(root):
    """(file name, index, document) of every YAML document, in order."""
    d = os.path.join(root, MANIFESTS)
    docs = []
    for name in sorted(os.listdir(d)):
        if name.endswith((".yaml", ".yml")):
            with open(os.path.join(d, name)) as f:
                for i, doc in enumerate(yaml.safe_load_all(f)):
                    if doc is not None:
                        docs.append((name, i, doc))
    return docs


def pod_spec(doc):
    if doc["kind"] == "Pod":
        return doc.get("spec")
    return doc.get("spec", {}).get("template", {}).get("spec")


def containers(spec):
    return spec.get("initContainers", []) + spec.get("containers", [])


def env_of(c):
    return {e["name"]: e.get("value") for e in c.get("env", [])}


def host_path(spec, c, path):
    """The node's path for `path` in container `c`: through the mount that
    holds it, of a hostPath volume (None when no such mount holds it)."""
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    best = None
    for m in c.get("volumeMounts", []):
        mp = m["mountPath"].rstrip("/") or "/"
        if path != mp and not path.startswith(mp.rstrip("/") + "/"):
            continue
        v = vols.get(m["name"], {})
        if "hostPath" not in v:
            continue
        if best is None or len(mp) > len(best[0]):
            base = posixpath.join(v["hostPath"]["path"], m.get("subPath", ""))
            best = (mp, base)
    if best is None:
        return None
    rest = path[len(best[0]):].lstrip("/")
    return posixpath.normpath(posixpath.join(best[1], rest))


def check_document(p, where, doc):
    kind = doc.get("kind")
    if kind not in API_VERSIONS:
        p.add(where, f"kind {kind!r} is not one the recipe knows")
        return
    if doc.get("apiVersion") != API_VERSIONS[kind]:
        p.add(where, f"{kind} needs apiVersion {API_VERSIONS[kind]}, has {doc.get('apiVersion')!r}")
    meta = doc.get("metadata") or {}
    if not DNS_LABEL.match(str(meta.get("name", ""))):
        p.add(where, f"metadata.name {meta.get('name')!r} is not a DNS label")
    if kind in NAMESPACED and not meta.get("namespace"):
        p.add(where, f"{kind} without metadata.namespace")
    if kind in WORKLOADS:
        check_workload(p, where, doc)


def check_workload(p, where, doc):
    spec = doc.get("spec") or {}
    tmpl = spec.get("template") or {}
    if doc["kind"] != "Job":
        sel = (spec.get("selector") or {}).get("matchLabels") or {}
        labels = (tmpl.get("metadata") or {}).get("labels") or {}
        if not sel or any(labels.get(k) != v for k, v in sel.items()):
            p.add(where, f"selector {sel} does not match the template's labels {labels}")
    ps = pod_spec(doc)
    if not ps or not ps.get("containers"):
        p.add(where, "no pod template with containers")
        return
    check_pod(p, where, ps)


def check_pod(p, where, spec):
    vols = {}
    for v in spec.get("volumes", []):
        if v["name"] in vols:
            p.add(where, f"volume {v['name']} declared twice")
        vols[v["name"]] = v
        hp = v.get("hostPath")
        if hp is not None:
            if not str(hp.get("path", "")).startswith("/"):
                p.add(where, f"volume {v['name']}: hostPath.path {hp.get('path')!r} is not absolute")
            if hp.get("type", "") not in HOSTPATH_TYPES:
                p.add(where, f"volume {v['name']}: hostPath.type {hp.get('type')!r}")
    used = set()
    for c in containers(spec):
        cw = f"{where} container {c.get('name')}"
        if not c.get("image"):
            p.add(cw, "no image")
        for m in c.get("volumeMounts", []):
            used.add(m["name"])
            if m["name"] not in vols:
                p.add(cw, f"volumeMount {m['name']} names no declared volume")
            if not m.get("mountPath", "").startswith("/"):
                p.add(cw, f"volumeMount {m['name']}: mountPath {m.get('mountPath')!r} is not absolute")
    for name in vols:
        if name not in used:
            p.add(where, f"volume {name} is mounted by no container")


def node_install(docs):
    """(where, pod spec, install container, problems) of the DaemonSet."""
    p = Problems()
    sets = [(f"{n}#{i}", d) for n, i, d in docs if n == NODE_FILE and d.get("kind") == "DaemonSet"]
    if len(sets) != 1:
        p.add(NODE_FILE, f"want one DaemonSet, found {len(sets)}")
        return None, None, None, p
    where, ds = sets[0]
    spec = pod_spec(ds)
    inits = [c for c in spec.get("initContainers", []) if GROUP_ENV in env_of(c)]
    if len(inits) != 1:
        p.add(where, f"want one init container with {GROUP_ENV} in its env")
        return where, spec, None, p
    return where, spec, inits[0], p


def install_script(c):
    cmd = c.get("command", []) + c.get("args", [])
    if len(cmd) != 3 or cmd[1] != "-c" or not cmd[0].endswith("sh"):
        return None
    return cmd[2]


def node_layout(docs):
    """What the install step puts on the node: {"lib": host path,
    "device": host path, "group": gid} and the problems found."""
    where, spec, c, p = node_install(docs)
    if c is None:
        return None, p
    script = install_script(c)
    if script is None:
        p.add(where, "the install container's command is not [SHELL, -c, SCRIPT]")
        return None, p
    env = env_of(c)
    init = [shlex.split(l) for l in script.splitlines() if " dev init " in l]
    if len(init) != 1:
        p.add(where, "the install script runs `smclo dev init` not exactly once")
        return None, p
    args = [expand(a, env) for a in init[0]]
    i = args.index("init")
    if args[i + 1:i + 2] != ["--group"] or len(args) != i + 4:
        p.add(where, f"`smclo dev init` arguments {args[i + 1:]}: want --group GID DIR")
        return None, p
    group, device = args[i + 2], args[i + 3]
    if not group.isdigit():
        p.add(where, f"the device's group {group!r} is not a number (a pod's supplementalGroups are)")
    layout = {"group": group, "device": host_path(spec, c, device)}
    if layout["device"] is None:
        p.add(where, f"the device directory {device} is in no hostPath volume")
    # Where the files land: the target of the script's `mv` into place.
    moves = [shlex.split(l) for l in script.splitlines() if l.strip().startswith("mv ")]
    libs = {posixpath.dirname(host_path(spec, c, expand(m[-1], env)) or "") for m in moves}
    if len(libs) != 1 or "" in libs:
        p.add(where, f"the install script puts {NODE_FILES} in no single hostPath directory: {libs}")
        return None, p
    missing = [f for f in NODE_FILES if f not in script]
    if missing:
        p.add(where, f"the install script does not install {missing}")
    layout["lib"] = libs.pop()
    check_device_readers(p, where, spec, layout)
    return layout, p


def check_device_readers(p, where, spec, layout):
    """The DaemonSet's containers that name a device (`--device DIR`) name
    the one the install step makes."""
    for ctr in spec.get("containers", []):
        cmd = ctr.get("command", [])
        if "--device" in cmd:
            d = cmd[cmd.index("--device") + 1]
            if host_path(spec, ctr, d) != layout["device"]:
                p.add(where, f"container {ctr['name']} reads device {d}, not the node's {layout['device']}")


def expand(word, env):
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: env.get(m.group(1), m.group(0)), word)


def check_app(p, where, spec, layout):
    """A pod spec that preloads smclo: LD_PRELOAD in the node's library
    directory, SMCLO_DEVICE_DIR the mounted node device, its group among
    the pod's supplementary groups."""
    groups = [str(g) for g in (spec.get("securityContext") or {}).get("supplementalGroups", [])]
    if layout["group"] not in groups:
        p.add(where, f"supplementalGroups {groups} lack the device's group {layout['group']}")
    for c in spec.get("containers", []):
        cw = f"{where} container {c['name']}"
        env = env_of(c)
        pre = env.get("LD_PRELOAD")
        if not pre or host_path(spec, c, pre) is None:
            p.add(cw, f"LD_PRELOAD {pre!r} is in no hostPath volume")
        else:
            hp = host_path(spec, c, pre)
            if posixpath.dirname(hp) != layout["lib"] or posixpath.basename(hp) not in NODE_FILES:
                p.add(cw, f"LD_PRELOAD {pre} is {hp} on the node, not a library of {layout['lib']}")
            if not mount_of(c, pre).get("readOnly"):
                p.add(cw, "the library directory is mounted writable")
        dev = env.get(DEVICE_ENV)
        mounts = [m["mountPath"] for m in c.get("volumeMounts", [])]
        if dev not in mounts:
            p.add(cw, f"{DEVICE_ENV} {dev!r} is not a mount path ({mounts})")
        elif host_path(spec, c, dev) != layout["device"]:
            p.add(cw, f"{DEVICE_ENV} {dev} is {host_path(spec, c, dev)} on the node, not {layout['device']}")


def mount_of(c, path):
    ms = [m for m in c.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
    return max(ms, key=lambda m: len(m["mountPath"])) if ms else {}


def app_specs(docs):
    return [(f"{n}#{i} {d['kind']} {d['metadata']['name']}", pod_spec(d))
            for n, i, d in docs
            if n != NODE_FILE and d.get("kind") in WORKLOADS | {"Pod"}]


def check_dockerfile(p, root, path):
    """Every COPY source (but --from ones) exists in the build context
    (the repository's root) and every repository script a RUN names is
    there and executable."""
    rel = os.path.relpath(path, root)
    with open(path) as f:
        lines = f.read().replace("\\\n", " ").splitlines()
    stages = 0
    for n, l in enumerate(lines, 1):
        words = l.split()
        if not words or words[0].startswith("#"):
            continue
        op = words[0].upper()
        if op == "FROM":
            stages += 1
        elif op == "COPY" and not any(w.startswith("--from") for w in words):
            for src in [w for w in words[1:-1] if not w.startswith("--")]:
                if not os.path.exists(os.path.join(root, src)):
                    p.add(f"{rel}:{n}", f"COPY source {src} does not exist")
        elif op == "RUN":
            for w in re.findall(r"(?<![\w/.])((?:scripts|crates|deploy)/[\w./-]+)", l):
                f = os.path.join(root, w)
                if not (os.path.isfile(f) and os.access(f, os.X_OK)):
                    p.add(f"{rel}:{n}", f"RUN names {w}, not an executable file here")
    text = "\n".join(lines)
    for need in ["cargo build --release --workspace", "scripts/build-musl-preload"]:
        if need not in text:
            p.add(rel, f"does not run {need}")
    for f in NODE_FILES:
        if f not in text:
            p.add(rel, f"does not install {f}")
    if stages < 2:
        p.add(rel, "not a multi-stage build")


def image_dirs(docs):
    """The image's directories the DaemonSet runs and copies from: its
    install container's paths outside hostPath volumes, and each
    container's program's directory."""
    where, spec, c, _ = node_install(docs)
    if c is None:
        return set()
    dirs = {v.rstrip("/") for v in env_of(c).values()
            if v.startswith("/") and host_path(spec, c, v) is None}
    for ctr in spec.get("containers", []):
        prog = ctr.get("command", [""])[0]
        if prog.startswith("/"):
            dirs.add(posixpath.dirname(prog))
    return dirs


def check_image_dir(p, root, path, docs):
    """The Dockerfile's last stage copies the built files to the directory
    the DaemonSet takes them from."""
    rel = os.path.relpath(path, root)
    with open(path) as f:
        last = f.read().rsplit("\nFROM ", 1)[-1]
    dests = {w[-1].rstrip("/") for w in (l.split() for l in last.splitlines())
             if w and w[0].upper() == "COPY"}
    for d in image_dirs(docs) - dests:
        p.add(rel, f"the DaemonSet takes smclo from {d}, where the image's last stage copies nothing")


def dockerfiles(root):
    for d, _, files in os.walk(os.path.join(root, "deploy")):
        for f in files:
            if f == "Dockerfile" or f.endswith(".Dockerfile"):
                yield os.path.join(d, f)


def check(root):
    p = Problems()
    docs = documents(root)
    kinds = {d.get("kind") for _, _, d in docs}
    for need in ["DaemonSet", "Namespace", "ServiceAccount"]:
        if need not in kinds:
            p.add(MANIFESTS, f"no {need}")
    for n, i, d in docs:
        check_document(p, f"{n}#{i} {d.get('kind')}", d)
    layout, lp = node_layout(docs)
    p.extend(lp)
    apps = app_specs(docs)
    if not apps:
        p.add(MANIFESTS, "no application pod spec")
    if layout:
        for where, spec in apps:
            check_app(p, where, spec, layout)
    files = list(dockerfiles(root))
    if not files:
        p.add("deploy", "no Dockerfile")
    for f in files:
        check_dockerfile(p, root, f)
        check_image_dir(p, root, f, docs)
    for line in p:
        print(line)
    return 1 if p else 0


def node(root, out):
    docs = documents(root)
    layout, p = node_layout(docs)
    if p:
        print("\n".join(p), file=sys.stderr)
        return 1
    where, spec, c, _ = node_install(docs)
    with open(out, "w") as f:
        f.write(install_script(c))
    for name, value in env_of(c).items():
        hp = host_path(spec, c, value) if value.startswith("/") else None
        if name == GROUP_ENV:
            print(f"group {name} {value}")
        elif hp is not None:
            print(f"host {name} {hp}")
        else:
            print(f"image {name} {value}")
    for cap in ((c.get("securityContext") or {}).get("capabilities") or {}).get("add", []):
        print(f"cap {cap}")
    return 0


def app(root):
    where, spec = app_specs(documents(root))[0]
    c = spec["containers"][0]
    sc = spec.get("securityContext") or {}
    print(f"preload {posixpath.basename(env_of(c)['LD_PRELOAD'])}")
    print(f"uid {sc['runAsUser']}")
    print(f"gid {sc['runAsGroup']}")
    return 0


def main():
    cmd, root = sys.argv[1], sys.argv[2]
    if cmd == "check":
        return check(root)
    if cmd == "node":
        return node(root, sys.argv[3])
    return app(root)


if __name__ == "__main__":
    sys.exit(main())
