//! Pinned buffers and uploads on the host backend: plain memory and plain copies, which say so.

use vram_kernels::{DType, Device, PinnedBuffer};

#[test]
fn host_uploads_are_plain_copies_and_say_so() {
    let dev = Device::host(64 << 20);
    let values: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 7.0).collect();
    let mut buf = PinnedBuffer::new(&dev, values.len() * 2).unwrap();
    assert!(!buf.is_page_locked(), "the host backend has nothing to page-lock for");
    buf.write_f32(&values, DType::BF16).unwrap();
    let upload = dev.upload_async(&buf, &[values.len()], DType::BF16).unwrap();
    assert!(!upload.is_async());
    let t = upload.wait().unwrap();
    let expected: Vec<f32> = values.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
    assert_eq!(t.to_f32_vec().unwrap(), expected);
    assert!(dev.memory_allocated() >= 2000, "the tensor is counted in the device's memory");
}

#[test]
fn uploads_larger_than_the_buffer_or_to_another_device_are_errors() {
    let dev = Device::host(64 << 20);
    let buf = PinnedBuffer::new(&dev, 100).unwrap();
    let err = dev.upload_async(&buf, &[26], DType::F32).err().expect("104 bytes do not fit in 100");
    assert!(err.to_string().contains("104 bytes"), "{err}");
    let other = Device::host(64 << 20);
    assert!(other.upload_async(&buf, &[4], DType::F32).is_err());
    let mut buf = PinnedBuffer::new(&dev, 8).unwrap();
    assert!(buf.write_f32(&[1.0, 2.0, 3.0], DType::F32).is_err());
}
