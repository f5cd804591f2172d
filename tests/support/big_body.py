"""Sends one request with a body far over guard's limit, as four real clients do, and prints
the HTTP status each saw (or the error it raised instead).

Usage: python3 big_body.py HOST:PORT MIB
Prints one JSON object: {"curl": 413, "requests": 413, "http.client": 413, "ollama": 413}.
"""
import http.client
import json
import os
import subprocess
import sys
import tempfile


def body_file(mib):
    handle = tempfile.NamedTemporaryFile(prefix="guard-big-body-", delete=False)
    handle.truncate(mib << 20)
    handle.close()
    return handle.name


def with_curl(base, path):
    out = subprocess.run(
        ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "60",
         "-H", "content-type: application/json", "--data-binary", "@" + path, base + "/api/generate"],
        capture_output=True, text=True, check=False,
    )
    return int(out.stdout) if out.stdout.isdigit() else "error: curl exit %d" % out.returncode


def with_requests(base, path):
    import requests

    with open(path, "rb") as body:
        return requests.post(base + "/api/generate", data=body, timeout=60,
                             headers={"content-type": "application/json"}).status_code


def with_http_client(address, path):
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    with open(path, "rb") as body:
        conn.request("POST", "/api/generate", body=body,
                     headers={"content-type": "application/json",
                              "content-length": str(os.path.getsize(path))})
    return conn.getresponse().status


def with_ollama(base, mib):
    import ollama

    try:
        ollama.Client(host=base, timeout=60).generate(model="smollm2:135m", prompt="x" * (mib << 20))
        return 200
    except ollama.ResponseError as err:
        return err.status_code


def main():
    address, mib = sys.argv[1], int(sys.argv[2])
    base = "http://" + address
    path = body_file(mib)
    seen = {}
    try:
        for name, send in [
            ("curl", lambda: with_curl(base, path)),
            ("requests", lambda: with_requests(base, path)),
            ("http.client", lambda: with_http_client(address, path)),
            ("ollama", lambda: with_ollama(base, mib)),
        ]:
            try:
                seen[name] = send()
            except Exception as err:  # the point is what each client saw, errors included
                seen[name] = "error: %s: %s" % (type(err).__name__, err)
    finally:
        os.unlink(path)
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
