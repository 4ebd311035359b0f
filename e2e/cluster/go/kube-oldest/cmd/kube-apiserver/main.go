// Command kube-apiserver is the upstream API server, built from the
// k8s.io/kubernetes module so nodeguard's tests run against the real thing.
package main

import (
	"os"

	"k8s.io/component-base/cli"
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
)

func main() {
	os.Exit(cli.Run(app.NewAPIServerCommand()))
}
