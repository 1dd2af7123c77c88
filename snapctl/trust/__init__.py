"""Signed images and the trust policy, in the container ecosystem's formats.

A signature here is cosign's: a "simple signing" JSON payload naming the image's manifest
digest and the reference it was signed for, signed with an ECDSA key and stored in the
image's repository under the tag ``sha256-<hex>.sig``. The policy is containers-policy.json(5),
the file Podman, CRI-O and skopeo read, so one policy and one key pair serve every tool.

``keys`` owns the key files (cosign's encrypted private key and PEM public key: generate,
encrypt, decrypt, sign, verify); ``payload`` the simple-signing payload (build it, read it
strictly); ``store`` the signature manifest in the registry (attach a signature, read the
signatures of a digest); ``sign`` signing an image in a registry (``image sign``); ``policy``
the policy file (parse it, find the rule for a reference, evaluate it, ``verify_pull``);
``identity`` references as a policy compares them (the ``signedIdentity`` rules);
``verdict`` what a policy decided; ``errors`` the errors of all of these.

Nothing here imports :mod:`snapctl.registry`: ``store`` speaks to a registry through the
small protocol it declares, which :class:`snapctl.registry.client.RegistryClient` satisfies, so
the registry's own modules may call into this package.
"""
