//! Typed "no library / no device" errors: these run everywhere and check whichever case
//! applies to this machine.
use ibverbs_safe::*;

#[test]
fn missing_library_or_device_is_a_typed_error() {
    match devices() {
        Err(e @ Error::LibraryUnavailable { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.contains("libibverbs1") && msg.contains("rdma-core"),
                "{msg}"
            );
            assert!(!library_available());
            assert!(matches!(open(None), Err(Error::LibraryUnavailable { .. })));
        }
        Err(e) => panic!("listing devices failed unexpectedly: {e}"),
        Ok(list) if list.is_empty() => {
            assert!(library_available());
            match open(None) {
                Err(e @ Error::NoDevice { name: None, .. }) => {
                    let msg = e.to_string();
                    assert!(msg.contains("no RDMA device"), "{msg}");
                    println!("no device here, as expected: {msg}");
                }
                other => panic!("expected NoDevice, got {other:?}"),
            }
        }
        Ok(list) => println!("devices present ({list:?}): NoDevice is checked by name instead"),
    }
    assert!(matches!(
        open(Some("no-such-rdma-device")),
        Err(Error::NoDevice { .. } | Error::LibraryUnavailable { .. })
    ));
}
