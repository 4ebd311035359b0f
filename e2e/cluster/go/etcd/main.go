// Command etcd runs the upstream etcd server (etcdmain) for nodeguard's tests.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
