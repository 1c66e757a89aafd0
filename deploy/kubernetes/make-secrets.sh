#!/bin/sh
# The credentials deploy/kubernetes/ expects, made with openssl into DIR (mode 0700,
# every file 0600): a CA, the daemon's and the remote workers' certificates signed by
# it (their names in the namespace), and two bearer tokens. It talks to no cluster:
# docs/kubernetes.md shows the `kubectl create secret` commands that load DIR.
#
#   deploy/kubernetes/make-secrets.sh [-n NAMESPACE] [-d DAYS] DIR
set -eu

namespace=simpler
days=365
while getopts n:d: opt; do
    case $opt in
        n) namespace=$OPTARG ;;
        d) days=$OPTARG ;;
        *) echo "usage: $0 [-n NAMESPACE] [-d DAYS] DIR" >&2; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
if [ $# -ne 1 ]; then
    echo "usage: $0 [-n NAMESPACE] [-d DAYS] DIR" >&2
    exit 2
fi
dir=$1
if [ -e "$dir" ] && [ -n "$(ls -A "$dir")" ]; then
    echo "$0: $dir is not empty; give a new directory (nothing is overwritten)" >&2
    exit 1
fi
command -v openssl >/dev/null || { echo "$0: openssl is not installed" >&2; exit 1; }

umask 077
mkdir -p "$dir"
cd "$dir"

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout ca.key -out ca.crt -days "$days" -subj "/CN=simpler CA ($namespace)" \
    2>/dev/null

# cert NAME SERVICE: NAME.crt and NAME.key for the Service SERVICE of the namespace.
cert() {
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
        -keyout "$1.key" -out "$1.csr" -subj "/CN=$2.$namespace.svc" 2>/dev/null
    {
        printf 'subjectAltName=DNS:%s,DNS:%s.%s,DNS:%s.%s.svc,DNS:%s.%s.svc.cluster.local\n' \
            "$2" "$2" "$namespace" "$2" "$namespace" "$2" "$namespace"
        echo "basicConstraints=critical,CA:FALSE"
        echo "keyUsage=critical,digitalSignature"
        echo "extendedKeyUsage=serverAuth,clientAuth"
        echo "authorityKeyIdentifier=keyid"
    } > "$1.ext"
    openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial \
        -days "$days" -extfile "$1.ext" -out "$1.crt" 2>/dev/null
    rm -f "$1.csr" "$1.ext"
}
cert daemon simpler-daemon
cert worker simpler-remote-worker
rm -f ca.srl

openssl rand -hex 32 > daemon-token
openssl rand -hex 32 > remote-token
chmod 600 ./*
echo "made in $dir: ca.crt ca.key daemon.crt daemon.key worker.crt worker.key daemon-token remote-token"
