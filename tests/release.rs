//! The release as users get it, read back from the real test registry
//! (e2e/registry/up) after `e2e/release/publish`: the image index and each
//! platform's manifest verify against the release key, each platform's SBOM
//! comes back from its signed attestation and names exactly what the image
//! holds, and an image put under the signed tag by anyone else fails
//! verification. Fails (never skips) when the registry or the release is
//! missing.

mod support;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::{Command, Output};

use base64::Engine as _;
use serde_json::Value;
use support::*;

struct Release {
    registry: String,
    version: String,
    digest: String,
    platforms: Vec<String>,
    tools: PathBuf,
    public_key: PathBuf,
}

fn release() -> Release {
    let built = built_image();
    let registry = registry_addr().expect(
        "the test registry is not up: run e2e/registry/up and e2e/release/publish (make test does)",
    );
    let public_key = cache_dir().join("release/cosign.pub");
    assert!(
        public_key.is_file(),
        "{} is missing: run e2e/release/publish (make test does)",
        public_key.display()
    );
    Release {
        registry,
        version: built.version,
        digest: built.digest,
        platforms: built.platforms,
        tools: cached_path("e2e/release/tools"),
        public_key,
    }
}

impl Release {
    fn image(&self) -> String {
        format!("{}/nodeguard/nodeguard", self.registry)
    }
    fn crane(&self, args: &[&str]) -> String {
        let out = Command::new(self.tools.join("crane"))
            .args(args)
            .arg("--insecure")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "crane {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }
    fn cosign(&self, args: &[&str]) -> Output {
        Command::new(self.tools.join("cosign"))
            .args(args)
            .args(["--allow-http-registry", "--allow-insecure-registry"])
            .env("COSIGN_PASSWORD", "")
            .output()
            .unwrap()
    }
    /// `cosign verify` with a key, asking for this release's version (the
    /// `-a version=` annotation README's recipe asks for); the digests it
    /// vouched for.
    fn verify(&self, reference: &str, key: &std::path::Path) -> Result<Vec<String>, String> {
        let version = format!("version={}", self.version);
        let out = self.cosign(&[
            "verify",
            "--key",
            key.to_str().unwrap(),
            "--insecure-ignore-tlog",
            "-a",
            &version,
            reference,
        ]);
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        let sigs: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
        // The digests vouched for, once each (publishing the same build again
        // adds a signature over the same digest).
        let digests: BTreeSet<String> = sigs
            .iter()
            .map(|s| {
                s["critical"]["image"]["docker-manifest-digest"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect();
        Ok(digests.into_iter().collect())
    }
    /// Each platform's manifest digest in the published index.
    fn platform_digests(&self) -> Vec<(String, String)> {
        let index: Value = serde_json::from_str(
            &self.crane(&["manifest", &format!("{}@{}", self.image(), self.digest)]),
        )
        .unwrap();
        index["manifests"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                (
                    m["platform"]["architecture"].as_str().unwrap().to_string(),
                    m["digest"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    }
}

#[test]
fn the_tag_the_index_and_every_platform_verify_with_the_release_key() {
    let r = release();
    let tag = format!("{}:{}", r.image(), r.version);
    assert_eq!(
        r.crane(&["digest", &tag]).trim(),
        r.digest,
        "the tag names the index e2e/image built"
    );
    // What a verifier sees when it resolves the tag (an admission policy).
    let vouched = r
        .verify(&tag, &r.public_key)
        .expect("cosign verify of the tag");
    assert_eq!(vouched, vec![r.digest.clone()]);
    // What a node of each architecture pulls.
    let platforms = r.platform_digests();
    let archs: BTreeSet<_> = platforms.iter().map(|(a, _)| a.as_str()).collect();
    let want: BTreeSet<_> = r.platforms.iter().map(String::as_str).collect();
    assert_eq!(archs, want, "the index has one manifest per built platform");
    for (arch, digest) in &platforms {
        let vouched = r
            .verify(&format!("{}@{digest}", r.image()), &r.public_key)
            .unwrap_or_else(|e| panic!("cosign verify of linux/{arch}: {e}"));
        assert_eq!(&vouched, &vec![digest.clone()], "linux/{arch}");
    }
    // The chart, as `helm install oci://` fetches it.
    let chart = format!("{}/nodeguard/charts/nodeguard:{}", r.registry, r.version);
    r.verify(&chart, &r.public_key)
        .expect("cosign verify of the chart");
}

#[test]
fn each_platforms_sbom_comes_back_signed_and_names_exactly_what_the_image_holds() {
    let r = release();
    for (arch, digest) in r.platform_digests() {
        let reference = format!("{}@{digest}", r.image());
        let out = r.cosign(&[
            "verify-attestation",
            "--type",
            "cyclonedx",
            "--key",
            r.public_key.to_str().unwrap(),
            "--insecure-ignore-tlog",
            &reference,
        ]);
        assert!(
            out.status.success(),
            "cosign verify-attestation linux/{arch}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let line = String::from_utf8(out.stdout).unwrap();
        // One SBOM per manifest, however often it was published (the
        // registry keeps its data across runs; publish attests with --replace).
        assert_eq!(
            line.lines().count(),
            1,
            "linux/{arch}: cyclonedx attestations on {digest}"
        );
        let envelope: Value = serde_json::from_str(line.lines().next().unwrap()).unwrap();
        let statement: Value = serde_json::from_slice(
            &base64::engine::general_purpose::STANDARD
                .decode(envelope["payload"].as_str().unwrap())
                .unwrap(),
        )
        .unwrap();
        assert_eq!(
            statement["subject"][0]["digest"]["sha256"].as_str(),
            digest.strip_prefix("sha256:"),
            "linux/{arch}: the attestation is about this manifest"
        );
        let sbom = &statement["predicate"];
        assert_eq!(sbom["bomFormat"], "CycloneDX");
        let target = match arch.as_str() {
            "amd64" => "x86_64-unknown-linux-musl",
            "arm64" => "aarch64-unknown-linux-musl",
            other => panic!("unexpected platform {other}"),
        };
        assert_eq!(
            sbom["metadata"]["component"]["properties"]
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p["name"] == "nodeguard:rust-target")
                .map(|p| p["value"].clone()),
            Some(Value::from(target))
        );

        // Crates: exactly cargo's own view of what links into the binary
        // for that target (normal edges, no proc-macros), less nodeguard.
        let tree = Command::new("cargo")
            .args([
                "tree",
                "--locked",
                "-e",
                "normal,no-proc-macro",
                "--target",
                target,
            ])
            .args(["--prefix", "none", "-f", "{p}"])
            .current_dir(repo_root())
            .output()
            .unwrap();
        assert!(tree.status.success(), "cargo tree: {tree:?}");
        let from_cargo: BTreeSet<String> = String::from_utf8(tree.stdout)
            .unwrap()
            .lines()
            .map(|l| {
                let mut w = l.split_whitespace();
                format!("{} {}", w.next().unwrap(), w.next().unwrap())
            })
            .filter(|p| !p.starts_with("nodeguard "))
            .collect();
        let components = sbom["components"].as_array().unwrap();
        let crates: BTreeSet<String> = components
            .iter()
            .filter(|c| c["purl"].as_str().unwrap().starts_with("pkg:cargo/"))
            .map(|c| {
                format!(
                    "{} v{}",
                    c["name"].as_str().unwrap(),
                    c["version"].as_str().unwrap()
                )
            })
            .collect();
        assert_eq!(
            crates, from_cargo,
            "linux/{arch}: the SBOM's crates differ from cargo tree's"
        );
        assert!(crates.len() > 100, "linux/{arch}: {} crates", crates.len());

        // Files: every file in the pulled image is claimed by a component
        // (nodeguard itself, or the Debian package it was unpacked from),
        // and every claimed file is there.
        let mut claimed: BTreeSet<String> = BTreeSet::new();
        let evidence = |c: &Value, claimed: &mut BTreeSet<String>| {
            for o in c["evidence"]["occurrences"]
                .as_array()
                .into_iter()
                .flatten()
            {
                claimed.insert(
                    o["location"]
                        .as_str()
                        .unwrap()
                        .trim_start_matches('/')
                        .to_string(),
                );
            }
        };
        for c in components {
            evidence(c, &mut claimed);
        }
        for c in sbom["metadata"]["component"]["components"]
            .as_array()
            .unwrap()
        {
            evidence(c, &mut claimed);
        }
        let dir = TempDir::new("sbom");
        let tar = dir.path.join("fs.tar");
        r.crane(&["export", &reference, tar.to_str().unwrap()]);
        let listing = Command::new("tar").arg("-tvf").arg(&tar).output().unwrap();
        assert!(listing.status.success());
        let in_image: BTreeSet<String> = String::from_utf8(listing.stdout)
            .unwrap()
            .lines()
            .filter(|l| l.starts_with('-'))
            .map(|l| l.split_whitespace().last().unwrap().to_string())
            .collect();
        assert_eq!(
            in_image, claimed,
            "linux/{arch}: files in the image and files the SBOM names differ"
        );
        // Scanners: every Debian package says its source package (what
        // Debian's security data is keyed by), its version percent-encoded,
        // and ships its dpkg status entry and copyright file; the image says
        // which Debian it is; musl, linked into the binary, is its own
        // component with the version of the target's libc.a.
        let debs: Vec<&Value> = components
            .iter()
            .filter(|c| c["purl"].as_str().unwrap().starts_with("pkg:deb/debian/"))
            .collect();
        for c in &debs {
            let purl = c["purl"].as_str().unwrap();
            let name = c["name"].as_str().unwrap();
            assert!(purl.contains("&upstream="), "{purl}");
            assert!(purl.contains("&distro=debian-12"), "{purl}");
            assert!(!purl.split('?').next().unwrap().contains('+'), "{purl}");
            for f in [
                format!("var/lib/dpkg/status.d/{name}"),
                format!("usr/share/doc/{name}/copyright"),
            ] {
                assert!(
                    in_image.contains(&f),
                    "linux/{arch}: {f} is not in the image"
                );
            }
        }
        assert!(in_image.contains("usr/lib/os-release"));
        let musl = components
            .iter()
            .find(|c| c["name"] == "musl")
            .unwrap_or_else(|| panic!("linux/{arch}: no musl component"));
        assert!(
            musl["cpe"]
                .as_str()
                .unwrap()
                .starts_with("cpe:2.3:a:musl-libc:musl:1.")
        );
        let debs = debs.len();
        assert!(
            components.iter().any(|c| c["name"] == "systemd"
                && c["purl"]
                    .as_str()
                    .unwrap()
                    .contains(&format!("arch={arch}"))),
            "linux/{arch}: journalctl's package, of this architecture"
        );
        eprintln!(
            "linux/{arch}: {} crates, {debs} Debian packages, {} files: all in the SBOM",
            crates.len(),
            in_image.len()
        );
    }
}

#[test]
fn an_image_pushed_under_a_signed_tag_fails_verification() {
    let r = release();
    // A repository of its own, so the scenarios' tag stays as published.
    let repo = format!("{}/{}/nodeguard", r.registry, unique_name("tamper"));
    let tag = format!("{repo}:{}", r.version);
    r.crane(&["copy", &format!("{}@{}", r.image(), r.digest), &tag]);
    let key = cache_dir().join("release/cosign.key");
    let version = format!("version={}", r.version);
    let out = r.cosign(&[
        "sign",
        "--yes",
        "--key",
        key.to_str().unwrap(),
        "--tlog-upload=false",
        "-a",
        &version,
        &format!("{repo}@{}", r.digest),
    ]);
    assert!(out.status.success(), "cosign sign: {out:?}");
    assert_eq!(
        r.verify(&tag, &r.public_key).expect("the copy verifies"),
        vec![r.digest.clone()]
    );

    // Someone with write access to the repository puts another image under
    // the tag (here: the release's index with one label more), and signs it
    // with a key of their own.
    r.crane(&[
        "mutate",
        &tag,
        "--label",
        "org.opencontainers.image.title=not-nodeguard",
        "-t",
        &tag,
    ]);
    let swapped = r.crane(&["digest", &tag]).trim().to_string();
    assert_ne!(swapped, r.digest, "the tag now names another image");
    let dir = TempDir::new("keys");
    let made = Command::new(r.tools.join("cosign"))
        .args(["generate-key-pair", "--output-key-prefix", "other"])
        .env("COSIGN_PASSWORD", "")
        .current_dir(&dir.path)
        .output()
        .unwrap();
    assert!(made.status.success(), "cosign generate-key-pair: {made:?}");
    let out = r.cosign(&[
        "sign",
        "--yes",
        "--key",
        dir.path.join("other.key").to_str().unwrap(),
        "--tlog-upload=false",
        "-a",
        &version,
        &format!("{repo}@{swapped}"),
    ]);
    assert!(
        out.status.success(),
        "cosign sign with the other key: {out:?}"
    );

    let err = r
        .verify(&tag, &r.public_key)
        .expect_err("the swapped image must not verify with the release key");
    assert!(
        err.contains("no signatures found") || err.contains("no matching signatures"),
        "cosign's reason: {err}"
    );
    // Its own key vouches for it: the release key is what tells them apart.
    assert!(r.verify(&tag, &dir.path.join("other.pub")).is_ok());

    // A rollback: an image the release key did sign, for another version
    // (here the swapped one, signed as 0.0.1), put under this version's
    // tag. The signature is genuine; the version asked for is not in it.
    let out = r.cosign(&[
        "sign",
        "--yes",
        "--key",
        key.to_str().unwrap(),
        "--tlog-upload=false",
        "-a",
        "version=0.0.1",
        &format!("{repo}@{swapped}"),
    ]);
    assert!(out.status.success(), "cosign sign as 0.0.1: {out:?}");
    let err = r
        .verify(&tag, &r.public_key)
        .expect_err("an older release under this version's tag must not verify as this version");
    assert!(
        err.contains("no matching signatures"),
        "cosign's reason: {err}"
    );
    // Pinned by digest, the release still verifies.
    assert_eq!(
        r.verify(&format!("{repo}@{}", r.digest), &r.public_key)
            .expect("the release's digest"),
        vec![r.digest.clone()]
    );
}

#[test]
fn the_published_chart_pins_the_image_it_was_released_with() {
    let r = release();
    let out = Command::new(helm_binary())
        .args(["show", "values", "--plain-http", "--version", &r.version])
        .arg(format!("oci://{}/nodeguard/charts/nodeguard", r.registry))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "helm show values: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let values = String::from_utf8(out.stdout).unwrap();
    assert!(
        values.contains(&format!("  digest: \"{}\"", r.digest)),
        "the chart in the registry does not pin image.digest to {}:\n{values}",
        r.digest
    );
}
