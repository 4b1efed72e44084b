#!/usr/bin/env python3
"""Checks the TLS overlay (deploy/tls/statefulset-tls.yaml on top of deploy/, rendered by
tests/deploy/check.sh) against the cert-manager objects of deploy/tls/issuer.yaml: the node's
--tls-cert, --tls-key and --tls-ca are files of a cert-manager csi-driver volume mounted in the
shoal container, issued by the CA Issuer that issuer.yaml makes, for the pod's name under the
StatefulSet's headless Service (the address SHOAL_ADVERTISE gives, which peers verify) and for
the client Service; every probe asks over HTTPS with its path and port kept.

    tls_check.py RENDERED.yaml deploy/tls/issuer.yaml
"""

import sys

import yaml

CSI = "csi.cert-manager.io"


def main(rendered_path, issuer_path):
    objects = [o for o in yaml.safe_load_all(open(rendered_path)) if o]
    issuers = [o for o in yaml.safe_load_all(open(issuer_path)) if o]
    problems = []

    def check(ok, what):
        print(("ok: " if ok else "FAIL: ") + what)
        if not ok:
            problems.append(what)

    ca_issuers = {o["metadata"]["name"] for o in issuers if o["kind"] == "Issuer" and "ca" in o["spec"]}
    ca_secrets = {o["spec"]["ca"]["secretName"] for o in issuers if o["kind"] == "Issuer" and "ca" in o["spec"]}
    made = {o["spec"]["secretName"] for o in issuers if o["kind"] == "Certificate" and o["spec"].get("isCA")}
    check(len(ca_issuers) == 1, f"issuer.yaml makes one CA Issuer: {sorted(ca_issuers)}")
    check(ca_secrets and ca_secrets <= made, f"the CA Issuer's Secret {sorted(ca_secrets)} is a CA Certificate of issuer.yaml")

    sts = next(o for o in objects if o["kind"] == "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    container = next(c for c in pod["containers"] if c["name"] == "shoal")
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    csi_volume = None
    for var in ("SHOAL_TLS_CERT", "SHOAL_TLS_KEY", "SHOAL_TLS_CA"):
        path = env.get(var) or ""
        directory, _, _ = path.rpartition("/")
        volume = volumes.get(mounts.get(directory, ""), {})
        csi = volume.get("csi") or {}
        check(csi.get("driver") == CSI, f"{var}={path} is a file of a {CSI} volume mounted in the container")
        csi_volume = csi_volume or (csi if csi.get("driver") == CSI else None)
    attributes = (csi_volume or {}).get("volumeAttributes", {})
    issuer = attributes.get(f"{CSI}/issuer-name")
    check(issuer in ca_issuers and attributes.get(f"{CSI}/issuer-kind") == "Issuer",
          f"the volume's certificate comes from the CA Issuer of issuer.yaml ({issuer})")
    names = [n.strip() for n in attributes.get(f"{CSI}/dns-names", "").split(",")]
    headless = sts["spec"]["serviceName"]
    advertise = env.get("SHOAL_PEER_ADVERTISE", "")
    check("$(HEADLESS_SERVICE)" in advertise or headless in advertise,
          f"the peers' address is under the headless Service: {advertise}")
    own = f"${{POD_NAME}}.{headless}.${{POD_NAMESPACE}}.svc.cluster.local"
    check(own in names, f"the certificate names the pod's DNS name under {headless}: {own}")
    clients = [o["metadata"]["name"] for o in objects if o["kind"] == "Service" and o["spec"].get("clusterIP") != "None"]
    for service in clients:
        check(f"{service}.${{POD_NAMESPACE}}.svc.cluster.local" in names, f"the certificate names the client Service {service}")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = (container.get(probe) or {}).get("httpGet") or {}
        check(get.get("scheme") == "HTTPS" and get.get("path") and get.get("port"),
              f"{probe} asks over HTTPS, its path and port kept: {get}")
    if problems:
        print(f"{len(problems)} problem(s)")
        return 1
    print("all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
